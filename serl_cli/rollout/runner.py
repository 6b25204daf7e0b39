"""Run a policy over many episodes side by side and record every turn.

``dispatch: round`` (the default): all live episodes step in lockstep; each round the policy
decides for every live episode at once (one batched forward pass for a model policy), every
environment steps, and finished episodes leave the batch. ``dispatch: episode``: each episode
goes on alone, its next prompt handed to the engine the moment its environment has answered
and its reply to its environment the moment the engine has it (:func:`run_per_episode`), so no
turn waits for the round's slowest reply or step. One record per episode, one entry per turn:
an ``Episode`` holding its ``Turn`` s (``serl_cli.artifacts.records``).

An environment that raises or hangs ends only its own episode: the exception (or the
step timeout, enforced with SIGALRM on the main thread) is caught, the episode is closed
as a failure with ``error`` saying what happened and ``truncated`` true, and the other
episodes go on. A bad task id at reset (``EnvError``) is the user's input, not the
environment's fault, and still stops the run with its one-line message.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, get_args

from envs.base import AuthorsPrompted, EnvError, Step, World
from envs.base import Episode as EnvEpisode
from serl_cli.artifacts.records import Episode, Turn
from serl_cli.rollout.env_pool import EnvPool, RemoteEpisode
from serl_cli.rollout.env_step import start_episode, step_episode
from serl_cli.rollout.policies import Decision
from serl_cli.rollout.prompts import action_format_of


class Policy(Protocol):
    name: str

    def act(self, steps: list[Step], contexts: list[dict]) -> list[Decision]: ...


class EpisodePolicy(Protocol):
    """A policy that decides one episode's turn at a time (``dispatch: episode``): ``submit`` hands
    it one live episode's step, ``finished`` returns the decisions made since (waiting for at least
    one while any are being made), ``busy`` says whether any are."""

    name: str

    def submit(self, key: int, step: Step, context: dict) -> None: ...

    def finished(self) -> list[tuple[int, Decision]]: ...

    @property
    def busy(self) -> bool: ...

    def cancel(self) -> None: ...


Dispatch = Literal["round", "episode"]
DISPATCH = get_args(Dispatch)


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
    pool: EnvPool | None = None,
    dispatch: Dispatch = "round",
) -> list[Episode]:
    """Run ``specs`` with at most ``batch_size`` episodes live at once; records in spec order.
    ``pool``: the environments live in its worker processes and each round steps them at once
    (``rollout.env_workers``; ``serl_cli.rollout.env_pool``), with the same episodes as here.
    ``dispatch``: ``round`` (lockstep) or ``episode`` (:func:`run_per_episode`, for an
    :class:`EpisodePolicy`)."""
    envs = InProcess(world, split, max_turns, step_timeout_s) if pool is None else InWorkers(pool, split, max_turns)
    if dispatch == "episode":
        return run_per_episode(world, specs, policy, envs, batch_size, on_episode_done)  # type: ignore[arg-type]
    records: list[Episode | None] = [None] * len(specs)
    pending = list(range(len(specs)))[::-1]
    live: list[tuple[int, Any, Step, Episode]] = []  # (spec index, episode, current step, record)

    def close(i: int, rec: Episode) -> None:
        records[i] = rec
        if on_episode_done:
            on_episode_done(rec)

    def start_more():  # a finished episode's place goes to the next spec, in spec order
        while pending and len(live) < batch_size:
            places = [pending.pop() for _ in range(min(len(pending), batch_size - len(live)))]
            for i, (ep, first) in zip(places, envs.start(places, [specs[i] for i in places]), strict=True):
                rec = _record(specs[i])
                if ep is None:  # the environment failed to start it: closed as a failure
                    _fail(rec, first)
                    close(i, rec)
                else:
                    rec.instruction, rec.initial_observation = ep.instruction, first.observation
                    live.append((i, ep, first, rec))

    action_format = action_format_of(world)
    authors_prompt = world.authors_prompt if isinstance(world, AuthorsPrompted) else None  # prompt.style authors
    start_more()
    while live:
        # one round: the policy decides for every live episode at once, then each environment steps
        contexts = [_context(world, ep, rec, action_format, authors_prompt) for _, ep, _, rec in live]
        decisions = policy.act([step for _, _, step, _ in live], contexts)
        answers = envs.step([(ep, d.action) for (_, ep, _, _), d in zip(live, decisions, strict=True)])
        still_live, ended = [], []
        for (i, ep, step, rec), d, nxt in zip(live, decisions, answers, strict=True):
            if isinstance(nxt, str):  # the environment failed: the episode ends with the error, the run goes on
                _fail(rec, nxt)
            else:
                _record_turn(rec, step, d, nxt)
            if isinstance(nxt, str) or nxt.done:
                close(i, rec)
                ended.append(ep)
            else:
                still_live.append((i, ep, nxt, rec))
        envs.drop(ended)
        live = still_live
        start_more()
    return records  # type: ignore[return-value]


def run_per_episode(
    world: World,
    specs: list[EpisodeSpec],
    policy: EpisodePolicy,
    envs: InProcess | InWorkers,
    batch_size: int,
    on_episode_done: Callable[[Episode], None] | None,
) -> list[Episode]:
    """``dispatch: episode``: every live episode waits only for its own reply and its own step.
    The records are the ones round dispatch makes wherever each turn's reply depends on that turn
    alone (greedy decoding, coupled sampling): which episodes the engine decodes beside it, and when,
    does not enter. Episodes start in spec order as places free, as in round dispatch."""
    run = _PerEpisode(world, specs, policy, envs, batch_size, on_episode_done)
    try:
        run.start_more()
        while run.live:
            if policy.busy:  # one engine step: the replies it finished go to their environments at once
                for i, d in policy.finished():
                    run.acting[i] = d
                    envs.post(i, run.live[i][0], d.action)
            # the environments' answers so far; with no reply being made, wait for the next
            for i, nxt in envs.answers(wait=not policy.busy):
                run.answered(i, nxt)
            run.start_more()
    finally:
        if run.live:  # stopped (a stop request, an error): no reply of these turns may answer a later call
            policy.cancel()
    return run.records  # type: ignore[return-value]


class _PerEpisode:
    """The episodes of one :func:`run_per_episode` call: the records, the live ones and where each stands."""

    def __init__(self, world: World, specs, policy: EpisodePolicy, envs, batch_size: int, on_episode_done):
        self.world, self.specs, self.policy, self.envs = world, specs, policy, envs
        self.batch_size, self.on_episode_done = batch_size, on_episode_done
        self.records: list[Episode | None] = [None] * len(specs)
        self.pending = deque(range(len(specs)))
        self.live: dict[int, tuple[Any, Step, Episode]] = {}  # spec index -> (episode, current step, record)
        self.acting: dict[int, Decision] = {}  # the decision whose step the environment is taking
        self.action_format = action_format_of(world)
        self.authors_prompt = world.authors_prompt if isinstance(world, AuthorsPrompted) else None

    def ask(self, i: int) -> None:
        ep, step, rec = self.live[i]
        self.policy.submit(i, step, _context(self.world, ep, rec, self.action_format, self.authors_prompt))

    def start_more(self) -> None:
        places = [self.pending.popleft() for _ in range(min(len(self.pending), self.batch_size - len(self.live)))]
        if not places:
            return
        for i, (ep, first) in zip(places, self.envs.start(places, [self.specs[i] for i in places]), strict=True):
            rec = _record(self.specs[i])
            if ep is None:  # the environment failed to start it: closed as a failure
                _fail(rec, first)
                self.close(i, rec)
            else:
                rec.instruction, rec.initial_observation = ep.instruction, first.observation
                self.live[i] = (ep, first, rec)
                self.ask(i)

    def answered(self, i: int, nxt: Step | str) -> None:
        ep, step, rec = self.live[i]
        d = self.acting.pop(i)
        if isinstance(nxt, str):  # the environment failed: this episode ends with the error
            _fail(rec, nxt)
        else:
            _record_turn(rec, step, d, nxt)
        if isinstance(nxt, str) or nxt.done:
            del self.live[i]
            self.close(i, rec)
            self.envs.drop([ep])
        else:
            self.live[i] = (ep, nxt, rec)
            self.ask(i)

    def close(self, i: int, rec: Episode) -> None:
        self.records[i] = rec
        if self.on_episode_done:
            self.on_episode_done(rec)


class InProcess:
    """The environments in this process, stepped one after another."""

    def __init__(self, world: World, split: str, max_turns: int | None, step_timeout_s: float | None):
        self.world, self.split, self.max_turns, self.timeout = world, split, max_turns, step_timeout_s
        self._answered: list[tuple[int, Step | str]] = []

    def start(self, places: list[int], specs: list[EpisodeSpec]) -> list[tuple[EnvEpisode | None, Any]]:
        """(episode, its first step) per spec; (None, why) where the environment failed to start it."""
        return [start_episode(self.world, self.split, self.max_turns, spec.task_id, self.timeout) for spec in specs]

    def step(self, moves: list[tuple[EnvEpisode, str]]) -> list[Step | str]:
        """Each episode's next step, or why the environment failed."""
        return [step_episode(ep, action, self.timeout) for ep, action in moves]

    def post(self, i: int, ep: EnvEpisode, action: str) -> None:
        """Step one episode now (dispatch episode; the engine decodes the others meanwhile)."""
        self._answered.append((i, step_episode(ep, action, self.timeout)))

    def answers(self, wait: bool) -> list[tuple[int, Step | str]]:
        out, self._answered = self._answered, []
        return out

    def drop(self, episodes: list) -> None:
        pass


class InWorkers:
    """The environments in a pool's worker processes (``serl_cli.rollout.env_pool``), each round's steps at once."""

    def __init__(self, pool: EnvPool, split: str, max_turns: int | None):
        self.pool, self.split, self.max_turns, self.call = pool, split, max_turns, pool.new_call()

    def start(self, places: list[int], specs: list[EpisodeSpec]) -> list[tuple[RemoteEpisode | None, Any]]:
        jobs = [
            ((self.call, i), self.split, self.max_turns, spec.task_id) for i, spec in zip(places, specs, strict=True)
        ]
        out: list[tuple[RemoteEpisode | None, Any]] = []
        for (key, _, _, task_id), (status, answer) in zip(jobs, self.pool.start(jobs), strict=True):
            if status == "env_error":
                raise EnvError(answer)
            if status == "failed":
                out.append((None, answer))
            else:
                instruction, first, methods = answer
                out.append((RemoteEpisode(self.pool, key, task_id, instruction, methods), first))
        return out

    def step(self, moves: list[tuple[RemoteEpisode, str]]) -> list[Step | str]:
        return [answer for _, answer in self.pool.step([(ep.key, action) for ep, action in moves])]

    def post(self, i: int, ep: RemoteEpisode, action: str) -> None:
        """Hand one episode's action to its worker and go on (dispatch episode)."""
        self.pool.post_step(ep.key, action)

    def answers(self, wait: bool) -> list[tuple[int, Step | str]]:
        """The posted steps answered so far (waiting for one if ``wait``), by spec index."""
        answers = self.pool.posted_answers(None if wait else 0)
        return [(key[1], answer) for key, answer in answers if key[0] == self.call]  # not a stopped call's

    def drop(self, episodes: list[RemoteEpisode]) -> None:
        if episodes:
            self.pool.drop([ep.key for ep in episodes])


def _record(spec: EpisodeSpec) -> Episode:
    """A new episode's record; reward and success are set when it ends (_finish, _fail)."""
    return Episode(
        task_id=spec.task_id,
        group_id=spec.group_id,
        rollout_index=spec.rollout_index,
        turns=[],
        reward=0.0,
        success=False,
    )


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


def _record_turn(rec: Episode, step: Step, d: Decision, nxt: Step) -> None:
    """Record the turn ``d`` played from ``step`` (``nxt``: the environment's answer); the record is
    closed where the episode ends."""
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
