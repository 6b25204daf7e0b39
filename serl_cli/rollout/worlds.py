"""Settings shared by every stage: which environment, and how to build it."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import envs
from envs.base import Described, EnvError, Noticing, World
from serl_cli.config import setting
from serl_cli.errors import SerlError


@dataclass
class EnvConfig:
    name: str = setting(
        "webshop",
        "the environment: webshop, alfworld, sokoban, an installed serl.envs entry point, or "
        "package.module:factory (docs/ENVIRONMENTS.md)",
    )
    split: str | None = setting(
        None, "the split to run; null: the environment's evaluation split (WebShop test, ALFWorld valid_unseen)"
    )
    max_turns: int | None = setting(None, "turn limit per episode; null: the environment's (WebShop 15, ALFWorld 50)")
    settings: dict = setting(factory=dict, doc="environment-specific, e.g. {catalog: synthetic}")
    step_timeout_s: float | None = setting(
        60.0, "a reset or step taking longer ends its episode with an error; null: no limit"
    )


_WORLDS: dict[tuple, World] = {}


def build_world(cfg: EnvConfig) -> World:
    """Build (once per process) the environment's world and check the split exists."""
    if cfg.step_timeout_s is not None and not cfg.step_timeout_s > 0:
        raise SerlError(
            f"env.step_timeout_s must be a positive number of seconds (or null for no limit), got {cfg.step_timeout_s}"
        )
    if cfg.max_turns is not None and cfg.max_turns < 1:
        raise SerlError(f"--max-turns must be at least 1, got {cfg.max_turns}")
    key = (cfg.name, tuple(sorted((k, repr(v)) for k, v in cfg.settings.items())))
    try:
        if key not in _WORLDS:
            _WORLDS[key] = envs.make_world(cfg.name, **cfg.settings)
            _say_notice(_WORLDS[key])
        world = _WORLDS[key]
        if cfg.split is None:
            cfg.split = world.eval_split
        if cfg.split not in world.splits():
            raise EnvError(f"unknown {cfg.name} split {cfg.split!r}: choose one of {', '.join(world.splits())}")
    except EnvError as e:
        raise SerlError(str(e)) from None
    except (UnicodeDecodeError, OSError) as e:  # unreadable data files: name them rather than show a traceback
        what = (
            f"{e.filename}: {e.strerror}" if isinstance(e, OSError) and e.filename else f"{e.__class__.__name__}: {e}"
        )
        raise SerlError(f"cannot load the {cfg.name} environment's data ({what})") from None
    return world


def built_split(cfg: EnvConfig) -> str:
    """The split of ``cfg`` once :func:`build_world` has built its world (which resolves null to the
    world's evaluation split)."""
    assert cfg.split is not None, "build_world(cfg) resolves the split"
    return cfg.split


def _say_notice(world: World) -> None:
    """A world's ``notice`` (WebShop's ``catalog: auto`` without a data folder), once per process
    on stderr: by rank 0 alone under torchrun."""
    notice = world.notice if isinstance(world, Noticing) else None
    if notice and os.environ.get("RANK", "0") == "0":
        print(f"note: {notice}", file=sys.stderr, flush=True)


def world_info(world: World) -> dict:
    """What a manifest and ``eval.json`` record of the environment's data: its name and what the
    world's own ``info()`` says (WebShop: which catalog ran, the real one or serl's synthetic)."""
    return {"name": world.name, **(world.info() if isinstance(world, Described) else {})}
