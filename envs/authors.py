"""The paper authors' prompt recipe, what an environment supplies for ``prompt.style: authors``.

The authors' code (github.com/OliverLeeXZ/SERL at 5a2a85b, which vendors verl-agent's
``agent_system/``) prompts the policy with one user message per turn and no system message
(agent_system/multi_turn_rollout/rollout_loop.py:201-219), built from a per-environment template
(agent_system/environments/prompts/{alfworld,webshop,sokoban}.py) by its environment manager
(agent_system/environments/env_manager.py). Each environment package holds its templates and the
pieces only it knows (``envs/<name>/authors.py``); this module holds what the three share:

* the history block, their ``SimpleMemory.fetch`` (agent_system/memory/memory.py:81-100): the
  last K turns as ``[Observation n: '<obs>', Action n: '<action>']``, one per line, numbered
  from the episode's start;
* the reply rule of their projections (agent_system/environments/env_package/*/projection.py):
  the action is the text between the first ``<action>`` and the first ``</action>`` of the
  lower-cased reply, stripped; a reply without both tags, or without ``<think>`` and
  ``</think>`` (case-sensitive), or (ALFWorld, WebShop) with a CJK character is invalid, which
  is what the invalid-action penalty counts (verl/trainer/ppo/ray_trainer.py:198-222).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

CJK_RE = re.compile(r"[\u4e00-\u9fff]")  # alfworld/projection.py:59, webshop/projection.py:61
FORMAT = "the authors' format: <think>...</think>, then <action>...</action>"


@dataclass(frozen=True)
class AuthorsPrompt:
    """An environment's prompt and reply rule as the authors wrote them.

    ``message(instruction, past, observation, admissible, k)`` is the user message of a turn:
    ``past`` the episode's earlier turns as (observation, action) in the environment's own
    words, ``admissible`` the actions to list, ``k`` how many past turns to show (0: none, as
    at the first turn). ``project(reply)`` is (the action handed to the environment, why the
    reply is invalid under their rule, or None).
    """

    message: Callable[[str, list[tuple[str, str]], str, list[str], int], str]
    project: Callable[[str], tuple[str, str | None]]


def history_block(past: list[tuple[str, str]], k: int) -> tuple[str, int]:
    """(the last ``k`` turns of ``past`` as memory.py:88-97 writes them, how many that is)."""
    recent = past[-k:] if k > 0 else []
    first = len(past) - len(recent)
    lines = [
        f"[Observation {first + j + 1}: '{obs}', Action {first + j + 1}: '{act}']"
        for j, (obs, act) in enumerate(recent)
    ]
    return "\n".join(lines), len(recent)


def history_fields(past: list[tuple[str, str]], k: int) -> dict:
    """The history fields every authors' template fills: :func:`history_block` of ``past``, and
    the step numbers (the turns so far, and the current one)."""
    history, shown = history_block(past, k)
    return {"step_count": len(past), "history_length": shown, "action_history": history, "current_step": len(past) + 1}


def tagged_action(reply: str) -> str | None:
    """The lower-cased reply between its first ``<action>`` and first ``</action>``, stripped
    (alfworld/projection.py:30-47); None without either tag. As theirs, a ``</action>`` before
    the ``<action>`` gives the empty action."""
    lowered = reply.lower()
    start, end = lowered.find("<action>"), lowered.find("</action>")
    if start == -1 or end == -1:
        return None
    return lowered[start + len("<action>") : end].strip()


def reply_problem(reply: str, *, cjk: bool = True) -> str | None:
    """Why ``reply`` is invalid under the authors' rule, or None (projection.py: both action
    tags, both think tags, and for ALFWorld and WebShop no CJK character)."""
    if tagged_action(reply) is None:
        return f"invalid reply: no <action>...</action> ({FORMAT})"
    if reply.find("<think>") == -1 or reply.find("</think>") == -1:
        return f"invalid reply: no <think>...</think> ({FORMAT})"
    if cjk and CJK_RE.search(reply):
        return "invalid reply: it holds CJK characters (the authors' rule)"
    return None


def project_text_action(reply: str, tail_chars: int) -> tuple[str, str | None]:
    """ALFWorld's and WebShop's projection: the tagged action, or without the tags the last
    ``tail_chars`` characters of the lower-cased reply (alfworld/projection.py:40, 30 characters;
    webshop/projection.py:41, 20), which the environment then rejects."""
    action = tagged_action(reply)
    if action is None:
        action = reply.lower()[-tail_chars:]
    return action, reply_problem(reply)
