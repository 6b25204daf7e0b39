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
from typing import Protocol


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

    Optional: ``action_format`` (an :class:`ActionFormat`) and ``authors_prompt`` (an
    ``envs.authors.AuthorsPrompt``: the paper authors' prompt and reply rule, for
    ``prompt.style: authors``; ALFWorld, WebShop and Sokoban have one).
    """

    name: str
    rules: str  # the action format and rules, for the policy's system message
    eval_split: str  # the split `serl eval` scores when none is given

    def splits(self) -> list[str]: ...

    def num_tasks(self, split: str) -> int: ...

    def new_episode(self, split: str, max_turns: int | None = None) -> Episode: ...
