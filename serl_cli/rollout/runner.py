"""Run a policy over many episodes side by side and record every turn.

All live episodes step in lockstep: each round the policy decides for every live
episode at once (one batched forward pass for a model policy), every environment steps,
and finished episodes leave the batch. One record per episode, one entry per turn: an
``Episode`` holding its ``Turn`` s (``serl_cli.artifacts.records``).

An environment that raises or hangs ends only its own episode: the exception (or the
step timeout, enforced with SIGALRM on the main thread) is caught, the episode is closed
as a failure with ``error`` saying what happened and ``truncated`` true, and the other
episodes go on. A bad task id at reset (``EnvError``) is the user's input, not the
environment's fault, and still stops the run with its one-line message.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from envs.base import AuthorsPrompted, EnvError, Step, World
from envs.base import Episode as EnvEpisode
from serl_cli.artifacts.records import Episode, Turn
from serl_cli.rollout.policies import Decision
from serl_cli.rollout.prompts import action_format_of


class StepTimeout(Exception):
    """An environment call ran past ``step_timeout_s``."""


@contextmanager
def time_limit(seconds: float | None):
    """Raise :class:`StepTimeout` in the block after ``seconds``. SIGALRM interrupts a hung
    Python loop or a blocking call; it exists only on the main thread, so elsewhere (a
    library embedding serl in a worker thread) the block runs without a limit. A timer already
    set outside (a test runner's own limit) is put back afterwards with the time it has left."""
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def on_alarm(signum, frame):
        raise StepTimeout(f"no answer within {seconds:g} s (env.step_timeout_s)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    outer_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left > 0:  # the outer timer fires at once if its time ran out meanwhile
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - started), 1e-3))


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0][:300] if str(e).strip() else ""
    return f"environment {'timed out' if isinstance(e, StepTimeout) else 'raised ' + type(e).__name__}" + (
        f": {text}" if text else ""
    )


class Policy(Protocol):
    name: str

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]: ...


@dataclass
class EpisodeSpec:
    """Which task to run and where the episode belongs in its group."""

    task_id: int
    group_id: int = 0
    rollout_index: int = 0


def run_episodes(
    world: World,
    split: str,
    specs: list[EpisodeSpec],
    policy: Policy,
    *,
    max_turns: int | None = None,
    batch_size: int = 64,
    on_episode_done: Callable[[Episode], None] | None = None,
    step_timeout_s: float | None = None,
) -> list[Episode]:
    """Run ``specs`` with at most ``batch_size`` episodes live at once; records in spec order."""
    records: list[Episode | None] = [None] * len(specs)
    pending = list(range(len(specs)))[::-1]
    live: list[tuple[int, EnvEpisode, Step, Episode]] = []  # (spec index, episode, current step, record)

    def close(i: int, rec: Episode) -> None:
        records[i] = rec
        if on_episode_done:
            on_episode_done(rec)

    def start_more():  # a finished episode's place goes to the next spec, in spec order
        while pending and len(live) < batch_size:
            i = pending.pop()
            rec, started = _start(world, split, specs[i], max_turns, step_timeout_s)
            if started is None:
                close(i, rec)
            else:
                ep, step = started
                live.append((i, ep, step, rec))

    action_format = action_format_of(world)
    authors_prompt = world.authors_prompt if isinstance(world, AuthorsPrompted) else None  # prompt.style authors
    start_more()
    while live:
        # one round: the policy decides for every live episode at once, then each environment steps
        contexts = [_context(world, ep, rec, action_format, authors_prompt) for _, ep, _, rec in live]
        decisions = policy.act([step for _, _, step, _ in live], contexts)
        still_live = []
        for (i, ep, step, rec), d in zip(live, decisions, strict=True):
            nxt = _advance(ep, step, d, rec, step_timeout_s)
            if nxt is None or nxt.done:
                close(i, rec)
            else:
                still_live.append((i, ep, nxt, rec))
        live = still_live
        start_more()
    return records  # type: ignore[return-value]


def _start(
    world: World, split: str, spec: EpisodeSpec, max_turns: int | None, step_timeout_s: float | None
) -> tuple[Episode, tuple[EnvEpisode, Step] | None]:
    """A new episode of ``spec``'s task and its record, with the episode and its first step; no
    episode (None) where the environment failed to start it, the record then closed as a failure."""
    # reward and success are set when the episode ends (_finish, _fail)
    rec = Episode(
        task_id=spec.task_id,
        group_id=spec.group_id,
        rollout_index=spec.rollout_index,
        turns=[],
        reward=0.0,
        success=False,
    )
    try:
        with time_limit(step_timeout_s):
            ep = world.new_episode(split, max_turns)
            step = ep.reset(spec.task_id)
    except EnvError:
        raise
    except Exception as e:  # any failure of the environment ends this episode only
        _fail(rec, _describe(e))
        return rec, None
    rec.instruction, rec.initial_observation = ep.instruction, step.observation
    return rec, (ep, step)


def _context(world: World, ep: EnvEpisode, rec: Episode, action_format, authors_prompt) -> dict:
    """What the policy reads of one live episode besides its current step (the prompt's parts)."""
    return {
        "instruction": ep.instruction,
        "turns": rec.turns,
        "rules": world.rules,
        "action_format": action_format,
        "authors_prompt": authors_prompt,
        "episode": ep,
        "row": (rec.group_id, rec.rollout_index),
    }


def _advance(ep: EnvEpisode, step: Step, d: Decision, rec: Episode, step_timeout_s: float | None) -> Step | None:
    """Step ``ep`` by the decision and record the turn; the record is closed where the episode ends
    (done: finished; None: the environment failed, and the turn is not recorded)."""
    try:
        with time_limit(step_timeout_s):
            nxt = ep.step(d.action)
    except Exception as e:  # the episode ends with the error; the run goes on
        _fail(rec, _describe(e))
        return None
    feedback = nxt.feedback.to_dict()
    if d.parse_error:  # the policy's reply held no well-formed action: say so, not just "invalid"
        feedback["error"] = d.parse_error
    rec.turns.append(
        Turn(
            turn=len(rec.turns),
            observation=step.observation,
            state_key=step.state_key,
            expert_action=step.expert_action,
            prompt_ids=d.prompt_ids,
            action_ids=d.action_ids,
            action_text=d.text,
            action=d.action,
            behaviour_logprobs=d.logprobs,
            next_observation=nxt.observation,
            next_state_key=nxt.state_key,
            feedback=feedback,
            reward=nxt.reward,
            done=nxt.done,
            info=nxt.info,
            off_expert=bool(d.off_expert),
            invalid=d.invalid,
        )
    )
    if nxt.done:
        _finish(rec, nxt)
    return nxt


def _finish(rec: Episode, last: Step) -> None:
    rec.reward = float(last.reward)
    rec.success = bool(last.info.get("won", False))
    rec.num_turns = len(rec.turns)
    rec.invalid_actions = sum(1 for t in rec.turns if t.invalid_action)
    rec.truncated = bool(last.info.get("truncated", False))
    rec.error = None


def _fail(rec: Episode, error: str) -> None:
    """Close an episode the environment broke: a failure, cut short, saying why. The turn
    whose step failed is not recorded (it has no next state)."""
    rec.reward = 0.0
    rec.success = False
    rec.num_turns = len(rec.turns)
    rec.invalid_actions = sum(1 for t in rec.turns if t.invalid_action)
    rec.truncated = True
    rec.error = error
