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
import math
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from serl_cli.errors import SerlError


@dataclasses.dataclass(frozen=True)
class Limit:
    """The values a number setting may take: those ``ok`` accepts, said as ``says`` ("at least 1"),
    declared beside the setting's doc and checked by :func:`check_limits` (None, where a setting
    allows it, is never checked: it means "unset")."""

    ok: Callable[[Any], bool]
    says: str


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _whole(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def at_least(low: float, says: str | None = None, *, whole: bool = False) -> Limit:
    """``low`` or more (a whole number where ``whole``)."""
    return Limit(lambda x: (_whole(x) if whole else _finite(x)) and x >= low, says or f"at least {low}")


def above(low: float, says: str | None = None) -> Limit:
    """More than ``low``."""
    return Limit(lambda x: _finite(x) and x > low, says or f"above {low}")


def within(
    low: float, high: float, says: str | None = None, *, open_low: bool = False, open_high: bool = False
) -> Limit:
    """Between ``low`` and ``high``, each end included unless open."""

    def ok(x) -> bool:
        return _finite(x) and (x > low if open_low else x >= low) and (x < high if open_high else x <= high)

    return Limit(ok, says or f"in {'(' if open_low else '['}{low}, {high}{')' if open_high else ']'}")


def setting(default: Any = dataclasses.MISSING, doc: str = "", *, factory=None, limit: Limit | None = None) -> Any:
    """A config field, its documentation and the values it may take: ``lr: float = setting(1e-6,
    "the step size", limit=at_least(0))``; a section, list or dict default is a ``factory``
    (``setting(factory=OptimConfig, doc=...)``)."""
    metadata = {"doc": doc, "limit": limit}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def limit_of(f: dataclasses.Field) -> Limit | None:
    return f.metadata.get("limit")


def check_limits(cfg, where: str = "") -> None:
    """Every setting of ``cfg`` (and of its sections) with a declared :class:`Limit` holds a value it
    allows, else one line: ``{where}{name} must be {says}, got {value}``."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            check_limits(value, f"{where}{f.name}.")
        elif (limit := limit_of(f)) is not None and value is not None and not limit.ok(value):
            raise SerlError(f"{where}{f.name} must be {limit.says}, got {value!r}")


def doc_of(cls, path: str) -> str:
    """The documentation of the field at ``path`` (``train.optim.lr``) of settings dataclass ``cls``."""
    f = None
    for part in path.split("."):
        f = {x.name: x for x in dataclasses.fields(cls)}[part]
        cls = typing.get_type_hints(cls)[part]
    return described(f) if f is not None else ""


def described(f: dataclasses.Field) -> str:
    """A setting's doc, and the values it may take where it declares a :class:`Limit`."""
    doc, limit = f.metadata.get("doc", ""), limit_of(f)
    return f"{doc} (must be {limit.says})" if limit is not None else doc


def choices(tp) -> tuple | None:
    """The words a ``Literal`` type (or ``Literal[...] | None``) allows; None for any other type."""
    if typing.get_origin(tp) is typing.Literal:
        return typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if typing.get_origin(arg) is typing.Literal:
                return typing.get_args(arg)
    return None


def check_choices(cfg, where: str = "") -> None:
    """Every ``Literal`` field of ``cfg`` (and of its sections) holds one of its words: the check
    a loaded config passed, for one built in code."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value, name = getattr(cfg, f.name), f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            check_choices(value, name)
        elif (words := choices(hints[f.name])) is not None and value is not None:
            _one_of(words, value, name)


def _one_of(words: tuple, value, where: str):
    if any(value == w and type(value) is type(w) for w in words):
        return value
    raise SerlError(f"unknown {where} {value!r}: choose one of {', '.join(map(str, words))}")


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
        if dataclasses.is_dataclass(default) and not isinstance(default, type) and isinstance(value, dict):
            value = merge(dataclasses.asdict(default), value)  # a partial section keeps the field's own defaults
        kwargs[name] = _coerce(hints[name], value, f"{where}.{name}" if where else name)
    return cls(**kwargs)


def _default_of(f: dataclasses.Field):
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _coerce(tp, value, where: str):
    """``value`` as a setting of type ``tp`` (a section, a choice of words, a union, a container or
    a scalar), or one line saying what the setting at ``where`` must be."""
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    if origin is typing.Literal:
        return _one_of(typing.get_args(tp), value, where)
    if origin in (typing.Union, types.UnionType):
        return _coerce_union(typing.get_args(tp), value, where)
    if tp is tuple or origin is tuple:  # YAML has lists only: a tuple setting loads as the tuple it dumped
        if not isinstance(value, (list, tuple)):
            raise SerlError(f"setting {where} must be a list, got {value!r}")
        return tuple(value)
    if tp is typing.Any or origin in (dict, list) or tp in (dict, list):
        want = origin or tp
        if want in (dict, list) and not isinstance(value, want):
            raise SerlError(f"setting {where} must be a {want.__name__}, got {value!r}")
        return value
    return _coerce_scalar(tp, value, where)


def _coerce_union(args: tuple, value, where: str):
    """``value`` as the first of the union's types that takes it; None only where the union allows it.
    Where none takes it, the first type's error says what the setting must be."""
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


def _coerce_scalar(tp, value, where: str):
    """``value`` as a bool, int, float or str setting: a bool is never a number (YAML's ``true`` is
    not 1), a float may be written as a string and a str as a number. Any other type takes the value
    as it is."""
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
    ``serl eval`` -- for ``cls``: the files, flags and ``--set`` keys for which
    ``reader.claims(data)`` holds merge, in that order, into one mapping of that schema (each
    file first seen by ``reader.check(data, where)``), and ``reader.read(mapping)`` -- settings
    of ``cls`` -- goes above ``base``, under the rest."""
    files = [config_file] if isinstance(config_file, (str, Path)) else list(config_file or [])
    layers: list[dict] = []
    theirs: dict = {}
    for path in files:
        layer = load_yaml(path)
        if reader is not None and reader.claims(layer):
            reader.check(layer, str(path))
            theirs = merge(theirs, layer)
        else:
            layers.append(layer)
    given = nest({k: v for k, v in flags.items() if v is not None})
    if reader is not None:
        theirs = merge(theirs, {k: v for k, v in given.items() if reader.claims({k: v})})
        given = {k: v for k, v in given.items() if not reader.claims({k: v})}
        claimed = [text for text in overrides if reader.claims(apply_overrides({}, [text]))]
        if claimed:
            reader.check(apply_overrides({}, claimed), "--set")
        theirs = apply_overrides(theirs, claimed)
        overrides = [text for text in overrides if text not in claimed]
    data = base or {}
    if reader is not None:
        data = merge(data, reader.read(theirs))
    for layer in layers:
        data = merge(data, layer)
    data = merge(data, given)
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
