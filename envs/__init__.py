"""serl's environments, one protocol (``envs.base``), registered by name."""

from __future__ import annotations

from typing import Callable

from envs.base import EnvError, Episode, Feedback, Step, World

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


def env_names() -> list[str]:
    return sorted(_REGISTRY)


def make_world(name: str, **settings) -> World:
    """Build an environment family's world by name; settings are its config fields."""
    if name not in _REGISTRY:
        raise EnvError(f"unknown environment {name!r}: choose one of {', '.join(env_names())}")
    try:
        return _REGISTRY[name](**settings)
    except TypeError as e:  # an unknown setting key
        raise EnvError(f"bad settings for environment {name!r}: {e}") from None


__all__ = ["EnvError", "Episode", "Feedback", "Step", "World", "env_names", "make_world", "register"]
