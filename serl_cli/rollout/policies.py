"""Policies that need no model: the environment's expert and a random clicker.

A policy maps the live episodes' current steps to one :class:`Decision` each. Model
policies (``serl_cli.rollout.engines``) return the same record plus token ids and log-probs.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from envs.base import Step


@dataclass
class Decision:
    action: str  # the action string handed to the environment
    text: str = ""  # what the policy wrote (for a model: the decoded generation)
    prompt_ids: list[int] = field(default_factory=list)
    action_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    parse_error: str | None = None  # the policy's output held no parseable action


class ExpertPolicy:
    """Follows the environment's reference action from each state."""

    name = "expert"

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        return [Decision(action=s.expert_action or "", text=s.expert_action or "") for s in steps]


class RandomPolicy:
    """Uniform over the admissible clicks; on a page with a search bar, searches a few of the
    instruction's words at random. Seeded, so a panel gives the same figure every run."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        out = []
        for step, ctx in zip(steps, contexts):
            choices = [a for a in step.admissible_actions if not a.endswith("[<query>]")]
            if len(choices) < len(step.admissible_actions) or not choices:
                words = re.findall(r"[a-z0-9']+", ctx.get("instruction", "").lower()) or ["item"]
                query = " ".join(self.rng.sample(words, k=min(len(words), self.rng.randint(2, 5))))
                choices = choices + [f"search[{query}]"]
            action = self.rng.choice(choices)
            out.append(Decision(action=action, text=action))
        return out
