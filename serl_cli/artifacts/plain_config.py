"""Configs as plain data: a settings dataclass as JSON-able data, a JSON copy, and the settings
two such configs differ in (dotted paths, in words for a one-line refusal).
"""

from __future__ import annotations

import json
from typing import Any


def json_copy(value):
    """``value`` as JSON reads it back (tuples become lists; a deep copy)."""
    return json.loads(json.dumps(value))


def to_plain(obj) -> dict:
    """A config dataclass as plain JSON-able data."""
    import dataclasses

    return dataclasses.asdict(obj)


_ABSENT = object()


def differences(stored, now, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """Every setting (dotted path, in ``stored``'s order, then ``now``'s) whose value differs
    between two plain configs, compared as JSON sees them."""
    stored, now = json.loads(json.dumps(stored)), json.loads(json.dumps(now))
    if not (isinstance(stored, dict) and isinstance(now, dict)):
        return [] if stored == now else [(prefix.rstrip("."), stored, now)]
    found: list[tuple[str, Any, Any]] = []
    for key in [*stored, *(k for k in now if k not in stored)]:
        a, b = stored.get(key, _ABSENT), now.get(key, _ABSENT)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, f"{prefix}{key}.")
        else:
            found.append((f"{prefix}{key}", a, b))
    return found


def first_difference(stored, now, prefix: str = "") -> tuple[str, Any, Any] | None:
    """The first of :func:`differences`; None when the configs are equal."""
    found = differences(stored, now, prefix)
    return found[0] if found else None


def differences_text(found: list[tuple[str, Any, Any]]) -> str:
    """``train.algo: stored grpo, now serl; rollout.tasks: stored 4, now 8``."""
    return "; ".join(difference_text(*d) for d in found)


def difference_text(key: str, stored, now) -> str:
    """``train.algo: stored grpo, now serl`` (a value one side lacks: ``unset``)."""

    def shown(v) -> str:
        return "unset" if v is _ABSENT else json.dumps(v) if not isinstance(v, str) else v

    return f"{key}: stored {shown(stored)}, now {shown(now)}"
