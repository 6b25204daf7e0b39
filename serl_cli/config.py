"""Configuration: dataclasses per stage, filled from defaults < YAML files < flags < ``--set``.

``--config`` may be repeated: the files compose left to right, each one's sections merging
key by key into the ones before. ``--set key.path=value`` parses the value as YAML (so
``3``, ``0.5``, ``true``, ``[a, b]`` and ``null`` mean what they look like). Unknown keys
are errors, never ignored -- a typo in an ablation grid must not silently run the
default -- and the error suggests the closest known key.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from serl_cli.errors import SerlError


def load_yaml(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SerlError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise SerlError(f"malformed YAML in {p}{where}: {getattr(e, 'problem', None) or e}") from None
    except UnicodeDecodeError:
        raise SerlError(f"config file {p} is not UTF-8 text") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SerlError(f"config file {p} must hold a mapping of settings, not a {type(data).__name__}")
    return data


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip() or any(not part for part in key.strip().split(".")):
        raise SerlError(f"malformed --set {text!r}: expected key.path=value")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        raise SerlError(f"malformed --set {text!r}: the value is not valid YAML") from None
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Return a copy of ``data`` with each ``key.path=value`` set."""
    out = _deep_copy(data)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise SerlError(f"--set {text!r}: {part!r} is a value, not a section")
            node = child
        node[path[-1]] = value
    return out


def merge(base: dict, update: dict) -> dict:
    """Recursive merge: ``update`` wins; sections merge key by key."""
    out = _deep_copy(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def _deep_copy(d: dict) -> dict:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in d.items()}


def from_dict(cls, data: dict, where: str = ""):
    """Build dataclass ``cls`` from a mapping, checking keys and basic types."""
    if not isinstance(data, dict):
        raise SerlError(f"setting {where or cls.__name__} must be a mapping")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        prefix = f"{where}." if where else ""
        close = difflib.get_close_matches(unknown[0], list(fields), n=1)
        hint = f": did you mean {prefix}{close[0]}?" if close else ""
        raise SerlError(f"unknown setting {prefix}{unknown[0]}{hint} (known: {', '.join(sorted(fields))})")
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        default = _default_of(fields[name])
        if dataclasses.is_dataclass(default) and isinstance(value, dict):
            value = merge(dataclasses.asdict(default), value)  # a partial section keeps the field's own defaults
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _coerce(tp, value, where: str):
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, where)
            except SerlError as e:
                errors.append(e)
        raise errors[0]
    if tp is tuple or origin is tuple:  # YAML has lists only: a tuple setting loads as the tuple it dumped
        if not isinstance(value, (list, tuple)):
            raise SerlError(f"setting {where} must be a list, got {value!r}")
        return tuple(value)
    if tp is typing.Any or origin in (dict, list) or tp in (dict, list):
        want = origin or tp
        if want in (dict, list) and not isinstance(value, want):
            raise SerlError(f"setting {where} must be a {want.__name__}, got {value!r}")
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SerlError(f"setting {where} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SerlError(f"setting {where} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-3" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise SerlError(f"setting {where} must be a number, got {value!r}")
    if tp is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
        raise SerlError(f"setting {where} must be a string, got {value!r}")
    return value


def resolve(
    cls,
    *,
    config_file: str | list[str] | None,
    flags: dict,
    overrides: list[str],
    base: dict | None = None,
    reader=None,
):
    """defaults < base (a stage's own defaults) < YAML files, left to right < flags given < --set.

    ``reader`` (optional) reads settings laid out as another schema -- a run file given to
    ``serl eval`` -- as ``cls``'s own: each file, and the ``--set`` keys, for which
    ``reader.claims(data)`` holds become ``reader.read(data, where)`` before they merge (the
    ``--set`` keys it claims merge after the flags, before the other ``--set`` keys)."""
    data = base or {}
    files = [config_file] if isinstance(config_file, (str, Path)) else list(config_file or [])
    for path in files:
        layer = load_yaml(path)
        if reader is not None and reader.claims(layer):
            layer = reader.read(layer, str(path))
        data = merge(data, layer)
    data = merge(data, nest({k: v for k, v in flags.items() if v is not None}))
    if reader is not None:
        theirs = [text for text in overrides if reader.claims(apply_overrides({}, [text]))]
        if theirs:
            data = merge(data, reader.read(apply_overrides({}, theirs), "--set"))
            overrides = [text for text in overrides if text not in theirs]
    data = apply_overrides(data, overrides)
    return from_dict(cls, data)


def nest(flat: dict) -> dict:
    """{"env.name": "webshop"} -> {"env": {"name": "webshop"}}."""
    out: dict = {}
    for key, value in flat.items():
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out
