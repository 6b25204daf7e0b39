"""Policies that need no model: the environment's expert (optionally noisy) and a random clicker.

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
    off_expert: bool = False  # a noisy expert's exploration move: the turn record says so, and SFT skips it
    # prompt.style authors: whether the reply broke the authors' format rule (the invalid-action penalty's
    # target, recorded on the turn); None: the environment's feedback.error decides, serl's rule
    invalid: bool | None = None


class ExpertPolicy:
    """Follows the environment's reference action from each state, or, with ``noise`` > 0, a noisy expert.

    A small model cloned from a perfect expert never sees the states its own mistakes lead
    to, and a warm start that solves everything leaves RL nothing to learn. So at each turn,
    with probability ``noise``, the noisy expert makes a random move other than the
    expert's, marked ``off_expert``: it only serves to reach an off-expert state, where the
    next turn demonstrates the expert again. Where the episode can tell which moves keep the
    task solvable (Sokoban's ``solvable_actions``) the random move is one of those, so the
    episode is not thrown away. ``blunders`` is the probability of taking, where one exists,
    a move that makes the task unsolvable instead: the failures that hindsight data
    (``train.hindsight_sft``) and the ``ref`` source need. Once the task is lost (no expert
    action) every move is random and off the expert. On its expert turns it picks at
    random among the episode's ``optimal_actions`` where it has them (Sokoban: every first
    move of a shortest solution), so its demonstrations teach what is optimal, not the
    solver's tie-break; a detour is a move that is not optimal.

    Draws are seeded per call, ``seed * 1_000_003 + calls``, as ``ModelPolicy`` seeds its
    sampling, so a resumed rollout (which sets ``calls``) draws what an uninterrupted one would.
    """

    name = "expert"

    def __init__(self, noise: float = 0.0, blunders: float = 0.0, seed: int = 0):
        self.noise, self.blunders, self.seed = noise, blunders, seed
        self.calls = 0

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        if not (self.noise or self.blunders):
            return [Decision(action=s.expert_action or "", text=s.expert_action or "") for s in steps]
        rng = random.Random(self.seed * 1_000_003 + self.calls)
        self.calls += 1
        out = []
        for step, ctx in zip(steps, contexts, strict=True):
            action, off = self._choose(step, ctx.get("episode"), rng)
            out.append(Decision(action=action, text=action, off_expert=off))
        return out

    def _choose(self, step: Step, episode, rng: random.Random) -> tuple[str, bool]:
        """(action, off the expert?) for one live episode."""
        expert, moves = step.expert_action, step.admissible_actions
        if expert is None:
            return (rng.choice(moves), True) if moves else ("", True)
        optimal = getattr(episode, "optimal_actions", lambda: [])() or [expert]
        solvable = getattr(episode, "solvable_actions", None)
        safe = solvable() if solvable else moves
        blunders = [a for a in moves if a not in safe]
        if blunders and rng.random() < self.blunders:
            return rng.choice(blunders), True
        detours = [a for a in safe if a not in optimal]
        if detours and rng.random() < self.noise:
            return rng.choice(detours), True
        return rng.choice(optimal), False


class RandomPolicy:
    """Uniform over the admissible clicks; on a page with a search bar, searches a few of the
    instruction's words at random. Seeded, so a panel gives the same figure every run."""

    name = "random"

    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]:
        out = []
        for step, ctx in zip(steps, contexts, strict=True):
            choices = [a for a in step.admissible_actions if not a.endswith("[<query>]")]
            if len(choices) < len(step.admissible_actions) or not choices:
                words = re.findall(r"[a-z0-9']+", ctx.get("instruction", "").lower()) or ["item"]
                query = " ".join(self.rng.sample(words, k=min(len(words), self.rng.randint(2, 5))))
                choices = choices + [f"search[{query}]"]
            action = self.rng.choice(choices)
            out.append(Decision(action=action, text=action))
        return out
