"""serl's environments, one protocol (``envs.base``), registered by name."""

from __future__ import annotations

from collections.abc import Callable

from envs.base import EnvError, Episode, Feedback, Step, World, capability_problems

_REGISTRY: dict[str, Callable[..., World]] = {}


def register(name: str):
    def wrap(factory):
        _REGISTRY[name] = factory
        return factory

    return wrap


@register("webshop")
def _webshop(**settings) -> World:
    from envs.webshop.env import WebShopConfig, WebShopWorld

    return WebShopWorld(WebShopConfig(**settings))


@register("alfworld")
def _alfworld(**settings) -> World:
    from envs.alfworld.env import AlfWorldConfig, AlfWorldWorld  # the engine itself loads only when an episode starts

    return AlfWorldWorld(AlfWorldConfig(**settings))


@register("sokoban")
def _sokoban(**settings) -> World:
    from envs.sokoban.env import SokobanConfig, SokobanWorld

    return SokobanWorld(SokobanConfig(**settings))


def env_names() -> list[str]:
    """The built-in environments, then any that installed packages add through the ``serl.envs``
    entry-point group (a built-in name wins over an entry point of the same name)."""
    return sorted(_REGISTRY) + sorted({ep.name for ep in _entry_points()} - set(_REGISTRY))


def make_world(name: str, **settings) -> World:
    """Build an environment family's world; settings are its config fields (keyword arguments).

    ``name`` is a built-in name (``webshop``), a ``package.module:factory`` path, or the name
    of a ``serl.envs`` entry point of an installed package. Any failure to find, call or
    check the factory is an :class:`EnvError` with a one-line message.
    """
    factory, plugin = _factory(name)
    try:
        world = factory(**settings)
    except TypeError as e:  # an unknown setting key
        raise EnvError(f"bad settings for environment {name!r}: {_first_line(e)}") from None
    if plugin:
        _check_world(name, world)
    problems = capability_problems(world)  # the optional members a world offers, checked once, here
    if problems:
        raise EnvError(f"environment {name!r}: {type(world).__name__}'s {'; '.join(problems)} (docs/ENVIRONMENTS.md)")
    return world


# -- plugins: `package.module:factory` and the `serl.envs` entry-point group -------------------

ENTRY_POINT_GROUP = "serl.envs"
WORLD_ATTRIBUTES = ("name", "rules", "eval_split", "splits", "num_tasks", "new_episode")
WORLD_METHODS = ("splits", "num_tasks", "new_episode")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _entry_points() -> list:
    """The ``serl.envs`` entry points of the installed distributions, read only when asked."""
    from importlib.metadata import entry_points

    try:
        return list(entry_points(group=ENTRY_POINT_GROUP))
    except Exception:  # a broken distribution's metadata must not break the built-ins
        return []


def _factory(name: str) -> tuple[Callable[..., World], bool]:
    """(the factory, whether it is a plugin): built-ins first, then a module path, then entry points."""
    if name in _REGISTRY:
        return _REGISTRY[name], False
    if ":" in name:
        return _load(name, name), True
    matches = [ep for ep in _entry_points() if ep.name == name]
    if matches:
        ep = matches[0]
        if not ep.attr:
            raise EnvError(
                f"environment {name!r}: entry point {ep.name} = {ep.value!r} names a module, "
                f"not a factory: write it as module:factory"
            )
        return _load(f"{ep.module}:{ep.attr}", name), True
    raise EnvError(
        f"unknown environment {name!r}: choose one of {', '.join(env_names())}, "
        f"or name a factory as package.module:function"
    )


def _load(spec: str, name: str) -> Callable[..., World]:
    """Import ``module:attr`` (attr may be dotted: ``module:Class.method``) and check it is callable."""
    import importlib
    import os
    import sys

    module_name, _, attr = spec.partition(":")
    module_name, attr = module_name.strip(), attr.strip()
    if not module_name or not attr:
        raise EnvError(f"bad environment {name!r}: write a factory as package.module:function")
    if (
        os.getcwd() not in sys.path and "" not in sys.path
    ):  # like `python -m`: a module in the working directory imports
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module_name)
    except ImportError as e:
        missing = getattr(e, "name", None)  # the module itself or a parent package is absent: say where it may be
        hint = (
            " (install it, or put its folder on PYTHONPATH or in the working directory)"
            if isinstance(e, ModuleNotFoundError) and missing and f"{module_name}.".startswith(f"{missing}.")
            else ""
        )
        raise EnvError(f"environment {name!r}: cannot import module {module_name!r}: {_first_line(e)}{hint}") from e
    except Exception as e:  # the module itself fails on import: name the error, not a traceback
        raise EnvError(
            f"environment {name!r}: importing module {module_name!r} raised {type(e).__name__}: {_first_line(e)}"
        ) from e
    path = module_name
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"environment {name!r}: {path!r} has no attribute {part!r}")
        obj, path = getattr(obj, part), f"{path}.{part}"
    if not callable(obj):
        raise EnvError(
            f"environment {name!r}: {path} is not callable (a {type(obj).__name__}): "
            f"name a function or class that returns a world"
        )
    return obj


def _check_world(name: str, world) -> None:
    """A plugin's factory must return an object with the World protocol's attributes (``envs.base``)."""
    missing = [a for a in WORLD_ATTRIBUTES if not hasattr(world, a)]
    missing += [a for a in WORLD_METHODS if a not in missing and not callable(getattr(world, a))]
    if missing:
        raise EnvError(
            f"environment {name!r}: the factory returned a {type(world).__name__} that is not a world "
            f"(missing or not callable: {', '.join(missing)}; see docs/ENVIRONMENTS.md)"
        )


__all__ = ["EnvError", "Episode", "Feedback", "Step", "World", "env_names", "make_world", "register"]
