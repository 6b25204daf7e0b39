"""The protocol every serl environment follows.

An environment family (WebShop, ALFWorld) owns heavy shared state -- a catalog, a search
index, game files -- in a *world* object, and hands out cheap *episodes* that reset to a
task of a split and step with an action string. Many episodes of one world step side by
side in one process for batched rollouts.

Per step an episode returns a :class:`Step` whose ``info`` carries the structured feedback
of METHOD.md section 3 that only the environment can give: ``error`` (the action was
invalid, with the reason) and ``diff`` (what changed on screen). The other sources
(``obs``, ``future``, ``ref``) are built later from stored rollouts.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


class EnvError(ValueError):
    """Bad input to an environment (unknown split, task id out of range, missing data).

    The CLI turns it into one line on stderr and exit code 2.
    """


@dataclass
class Feedback:
    """What the environment itself says about the last action."""

    error: str | None = None  # why the action was invalid or unparseable; None when it was fine
    diff: str = ""  # what changed between the screen before and after; "no change" is feedback too

    def to_dict(self) -> dict:
        return {"error": self.error, "diff": self.diff}


@dataclass(frozen=True)
class ActionFormat:
    """How an environment's actions look to a policy: the example shown in the system message,
    and which untagged replies count as a bare action. A world sets it as ``action_format``."""

    example: str  # e.g. click[buy now], go to countertop 1
    bare: re.Pattern  # an untagged reply that fully matches this is taken as the action

    def instruction(self) -> str:
        return f"Reply with your action inside <action></action>, for example <action>{self.example}</action>."


@dataclass
class Step:
    observation: str
    reward: float
    done: bool
    feedback: Feedback
    admissible_actions: list[str]
    state_key: str  # hash of the observation: matches turns of different rollouts of one task
    expert_action: str | None  # the reference action from this state, where one exists
    info: dict = field(default_factory=dict)  # environment-specific extras (page type, score, won)


def state_key(observation: str) -> str:
    """A short stable hash of a raw observation, used to match anchor states across rollouts."""
    return hashlib.sha1(observation.encode("utf-8")).hexdigest()[:16]


class Episode(Protocol):
    """One running task. ``reset`` starts it; ``step`` advances it by one action string."""

    task_id: int
    instruction: str

    def reset(self, task_id: int) -> Step: ...

    def step(self, action: str) -> Step: ...


class World(Protocol):
    """Shared, read-only state of an environment family: data, goals, splits.

    What a world may offer beyond these is declared below as small protocols, one per
    capability (:data:`CAPABILITIES`); serl asks ``isinstance(world, TaskTyped)``, never
    ``hasattr``, and ``envs.make_world`` checks a world's capabilities once, when it is built.
    """

    name: str
    rules: str  # the action format and rules, for the policy's system message
    eval_split: str  # the split `serl eval` scores when none is given

    def splits(self) -> list[str]: ...

    def num_tasks(self, split: str) -> int: ...

    def new_episode(self, split: str, max_turns: int | None = None) -> Episode: ...


# -- optional capabilities of a world --------------------------------------------------------------


@runtime_checkable
class ActionFormatted(Protocol):
    """Its actions' written form (:class:`ActionFormat`); without it, WebShop's."""

    action_format: ActionFormat


@runtime_checkable
class AuthorsPrompted(Protocol):
    """The paper authors' prompt and reply rule (an ``envs.authors.AuthorsPrompt``), for
    ``prompt.style: authors``."""

    authors_prompt: Any


@runtime_checkable
class Noticing(Protocol):
    """A line the user should read once when the world is built, or None (WebShop: a synthetic
    catalog stood in for the real one)."""

    @property
    def notice(self) -> str | None: ...


@runtime_checkable
class Described(Protocol):
    """What a manifest and ``eval.json`` record of its data (WebShop: which catalog ran)."""

    def info(self) -> dict: ...


@runtime_checkable
class TaskTyped(Protocol):
    """Each task's type, for success by type in ``eval.json`` (ALFWorld)."""

    def task_type(self, split: str, task_id: int) -> str: ...


@runtime_checkable
class CorpusTexts(Protocol):
    """Its own text for the default model's tokenizer (WebShop's catalog, Sokoban's boards)."""

    def corpus_texts(self) -> list[str]: ...


@runtime_checkable
class CorpusTasks(Protocol):
    """The tasks whose expert episodes the default tokenizer reads, where starting every task is
    slow (ALFWorld: a few of each type)."""

    def corpus_tasks(self, split: str) -> list[int]: ...


@runtime_checkable
class ModelPreset(Protocol):
    """The embedded default model's size for it (Sokoban: ``micro``); without it, ``tiny``."""

    model_preset: str


@runtime_checkable
class Cataloged(Protocol):
    """A catalog whose ``source`` names the data the default model was built from (WebShop)."""

    catalog: Any


CAPABILITIES: dict[str, type] = {
    "action_format": ActionFormatted,
    "authors_prompt": AuthorsPrompted,
    "notice": Noticing,
    "info": Described,
    "task_type": TaskTyped,
    "corpus_texts": CorpusTexts,
    "corpus_tasks": CorpusTasks,
    "model_preset": ModelPreset,
    "catalog": Cataloged,
}
METHOD_CAPABILITIES = ("info", "task_type", "corpus_texts", "corpus_tasks")  # called, not read


def capability_problems(world) -> list[str]:
    """What is wrong with the capabilities ``world`` offers (by its members' names), as the
    words of one error line: a method that is not callable, an action format that is not an
    :class:`ActionFormat`, a preset that is not a word."""
    problems = []
    for name in METHOD_CAPABILITIES:
        if hasattr(world, name) and not callable(getattr(world, name)):
            problems.append(f"{name} is not callable")
    if hasattr(world, "action_format") and not isinstance(world.action_format, ActionFormat):
        problems.append(f"action_format is a {type(world.action_format).__name__}, not an envs.base.ActionFormat")
    if hasattr(world, "model_preset") and not isinstance(world.model_preset, str):
        problems.append(f"model_preset is a {type(world.model_preset).__name__}, not a preset name")
    if hasattr(world, "catalog") and not hasattr(world.catalog, "source"):
        problems.append("catalog has no source")
    return problems


def capabilities(world) -> list[str]:
    """The capabilities ``world`` offers, by name (:data:`CAPABILITIES`)."""
    return [name for name, protocol in CAPABILITIES.items() if isinstance(world, protocol)]
