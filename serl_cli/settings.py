"""Settings shared by every stage: which environment, and how to build it."""

from __future__ import annotations

from dataclasses import dataclass, field

import envs
from envs.base import EnvError, World
from serl_cli.errors import SerlError


@dataclass
class EnvConfig:
    name: str = "webshop"
    split: str = "test"
    max_turns: int | None = None  # None: the environment's default (WebShop 15, ALFWorld 50)
    settings: dict = field(default_factory=dict)  # environment-specific, e.g. {catalog: synthetic}


_WORLDS: dict[tuple, World] = {}


def build_world(cfg: EnvConfig) -> World:
    """Build (once per process) the environment's world and check the split exists."""
    key = (cfg.name, tuple(sorted((k, repr(v)) for k, v in cfg.settings.items())))
    try:
        if key not in _WORLDS:
            _WORLDS[key] = envs.make_world(cfg.name, **cfg.settings)
        world = _WORLDS[key]
        if cfg.split not in world.splits():
            raise EnvError(f"unknown {cfg.name} split {cfg.split!r}: choose one of {', '.join(world.splits())}")
    except EnvError as e:
        raise SerlError(str(e)) from None
    return world
