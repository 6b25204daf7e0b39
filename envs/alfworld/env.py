"""The ALFWorld environment on its real engine: a world (game files, plans, a pool of
loaded engines) and cheap episodes, the same protocol as WebShop (``envs.base``).

Per step, ``info`` and the :class:`~envs.base.Step` carry:

* ``error``: the reason a command did nothing -- unparseable, or well-formed but not
  possible here (ALFWorld answers both with "Nothing happens.").
* ``diff``: what changed in the world (location, inventory, containers, objects moved or
  heated, cooled, cleaned, switched on), "no change" otherwise.
* ``state_key``: a hash of the world's facts (``feedback.state_key``).
* ``expert_action``: the next step of the game's cached planner plan while the agent is on
  it (or back on it); where it has strayed, alfworld's hand-coded expert from the current
  state (``envs.alfworld.expert``); never the online planner.

An inadmissible command leaves the game as it is, exactly as the engine would (TextWorld
changes nothing for a command it cannot match), so it is answered without stepping the
engine. Episodes borrow a loaded engine from the world's pool at reset and give it back
when they end: a repeat reset of a game costs a reset of its cached translation, not a
load (``envs.alfworld.engine``; docs/ALFWORLD.md has the figures).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from envs.alfworld import authors
from envs.alfworld import feedback as fb
from envs.alfworld.games import (
    DOWNLOAD_HINT,
    GAMES_DIR,
    SPLITS,
    TASK_TYPES,
    Game,
    check_split,
    data_root,
    file_sha256,
    list_games,
    require_engine,
)
from envs.alfworld.plans import default_plan_files, load_plans, plan_for
from envs.base import ActionFormat, EnvError, Feedback, Step

DEFAULT_MAX_TURNS = 50
NOTHING_HAPPENS = "Nothing happens."
TASK_PREFIX = "Your task is to: "

RULES = """You are in a household, in ALFWorld's text game. The first observation describes the room and your task.
Act with exactly one command per turn, one of the admissible commands listed each turn:
go to X, take X from Y, put X in/on Y, open X, close X, toggle X, heat X with Y, cool X with Y,
clean X with Y, use X, examine X, look, inventory.
A command that is not possible answers "Nothing happens.". You succeed when the task is done."""
# the example in the system message; an untagged reply is a bare command when it is one line of words
ACTION_FORMAT = ActionFormat(example="go to countertop 1", bare=re.compile(r"[a-z][a-z0-9 /'-]*"))


@dataclass
class AlfWorldConfig:
    data_dir: str | None = None  # the folder holding json_2.1.1/; default $ALFWORLD_DATA, else $SERL_DATA_DIR/alfworld
    max_turns: int = DEFAULT_MAX_TURNS
    plans: list[str] = field(default_factory=list)  # more plan files (serl data prepare --out)


class AlfWorldWorld:
    name = "alfworld"
    rules = RULES
    eval_split = "valid_unseen"
    action_format = ACTION_FORMAT
    authors_prompt = authors.PROMPT  # prompt.style authors (envs.authors)

    def __init__(self, config: AlfWorldConfig | None = None):
        self.config = config or AlfWorldConfig()
        require_engine()
        self.root = data_root(self.config.data_dir)
        if not (self.root / GAMES_DIR).is_dir():
            raise EnvError(
                f"no ALFWorld data at {self.root}: the games must be in {self.root}/{GAMES_DIR}/"
                f"<split>/ (SERL_DATA_DIR/alfworld or ALFWORLD_DATA); {DOWNLOAD_HINT}"
            )
        self.plans = load_plans(default_plan_files(self.root, self.config.plans))
        self._checked_plans: dict[str, list[str] | None] = {}
        self._idle: list[tuple[str, Any]] = []  # (game file, loaded engine), oldest first

    # -- tasks ----------------------------------------------------------------------------
    def splits(self) -> list[str]:
        return list(SPLITS)

    def games(self, split: str) -> list[Game]:
        return list_games(self.root, split)

    def num_tasks(self, split: str) -> int:
        return len(self.games(split))

    def game(self, split: str, task_id: int) -> Game:
        games = self.games(split)
        if not 0 <= task_id < len(games):
            raise EnvError(f"task id {task_id} out of range: ALFWorld split {split!r} has tasks 0..{len(games) - 1}")
        return games[task_id]

    def task_type(self, split: str, task_id: int) -> str:
        """The task's type by its short name (pick, look, clean, heat, cool, pick two): eval groups by it."""
        return TASK_TYPES[self.game(split, task_id).task_type]

    def plan(self, game: Game) -> list[str] | None:
        """The cached planner plan from the game's start, or None where it was never prepared."""
        if game.rel not in self._checked_plans:
            self._checked_plans[game.rel] = plan_for(game, self.plans, file_sha256)
        return self._checked_plans[game.rel]

    def corpus_texts(self) -> list[str]:
        """ALFWorld's own text for a tokenizer: the rules, the command forms and the cached plans."""
        plans = [" ; ".join(r["plan"]) for _, r in sorted(self.plans.items())]
        return [RULES, fb.COMMAND_HELP, NOTHING_HAPPENS] + plans

    def corpus_tasks(self, split: str, per_type: int = 6) -> list[int]:
        """A few tasks of each type (the panel is sorted by type): expert episodes for a tokenizer."""
        seen: dict[str, int] = {}
        picked = []
        for i, g in enumerate(self.games(split)):
            if seen.get(g.task_type, 0) < per_type:
                seen[g.task_type] = seen.get(g.task_type, 0) + 1
                picked.append(i)
        return picked

    def new_episode(self, split: str = "valid_unseen", max_turns: int | None = None) -> AlfWorldEpisode:
        check_split(split)
        return AlfWorldEpisode(self, split, max_turns or self.config.max_turns)

    # -- the engine pool ------------------------------------------------------------------
    def acquire(self, game: Game) -> Any:
        """A loaded engine for ``game``: an idle one already on it, else the oldest idle one
        reloaded, else a new one. An engine serves one episode at a time."""
        from envs.alfworld import engine

        path = str(game.path)
        for i, (loaded, env) in enumerate(self._idle):
            if loaded == path:
                del self._idle[i]
                return env
        if self._idle:
            _, env = self._idle.pop(0)
            env.load(path)
            return env
        return engine.start(path, facts=True)

    def release(self, game: Game, env: Any) -> None:
        """Take an engine back. Engines are kept, never closed: their number stays at the
        most episodes this process ever ran at once (the runner's batch size)."""
        self._idle.append((str(game.path), env))


@dataclass
class _Now:
    """The episode's current state, as the engine last reported it."""

    observation: str
    facts: frozenset  # positive fact tuples
    propositions: list  # the same facts as TextWorld propositions (the hand-coded expert reads these)
    admissible: list[str]
    won: bool

    @classmethod
    def of(cls, state) -> _Now:
        props = list(state["facts"])
        return cls(
            state["feedback"], fb.positive_facts(props), props, list(state["admissible_commands"]), bool(state["won"])
        )

    def as_state(self) -> dict:
        return {
            "feedback": self.observation,
            "facts": self.propositions,
            "admissible_commands": self.admissible,
            "won": self.won,
        }


class AlfWorldEpisode:
    def __init__(self, world: AlfWorldWorld, split: str, max_turns: int):
        self.world, self.split, self.max_turns = world, split, max_turns
        self.task_id, self.instruction = -1, ""
        self.game: Game | None = None
        self.task_type = ""
        self._env: Any = None  # the engine (a TextWorld environment) while a game is played
        self.turns, self.done = 0, True

    # -- protocol -------------------------------------------------------------------------
    def reset(self, task_id: int) -> Step:
        game = self.world.game(self.split, task_id)
        self.close()
        self.game, self.task_id, self.task_type = game, task_id, game.task_type
        self._env = self.world.acquire(game)
        self.now = _Now.of(self._env.reset())
        self.instruction = self.now.observation.split(TASK_PREFIX, 1)[-1].strip()
        self.turns, self.done = 0, False
        self.plan = self.world.plan(game) or []
        self.plan_pos: int | None = 0 if self.plan else None
        self._plan_states = {fb.state_key(self.now.facts): 0}  # plan positions reached, by state
        from envs.alfworld.expert import HandCodedReference

        self._handcoded = HandCodedReference(str(game.path), seed=task_id)
        self._handcoded_next = self._handcoded.start(self.now.as_state())
        return self._result(0.0, Feedback(error=None, diff="game start"), {})

    def step(self, action: str) -> Step:
        if self.done:
            raise EnvError("the episode is over: reset it before stepping")
        before = self.now
        command = fb.normalize(action)
        if command in before.admissible:
            state, _, _ = self._env.step(command)
            self.now, error = _Now.of(state), None
        else:  # the engine would change nothing and answer "Nothing happens."
            verb, args, error = fb.parse_command(action)
            if verb is not None:  # parsed: parse_command names a verb exactly when it reports no error
                error = f"{NOTHING_HAPPENS[:-1]}: {fb.why_inadmissible(verb, args, before.facts)}"
            self.now = _Now(NOTHING_HAPPENS, before.facts, before.propositions, before.admissible, before.won)
        self.turns += 1
        self._follow_plan(command, before.facts)
        self._handcoded_next = self._handcoded.after(command, self.now.as_state())
        self.done = self.now.won or self.turns >= self.max_turns
        truncated = self.done and not self.now.won
        diff = fb.describe_change(before.facts, self.now.facts)
        info = {"truncated": truncated, "invalid": error is not None}
        step = self._result(1.0 if self.now.won else 0.0, Feedback(error=error, diff=diff), info)
        if self.done:
            self.close()
        return step

    def close(self) -> None:
        """Give the engine back to the world's pool (done at the episode's end)."""
        if self._env is not None:
            assert self.game is not None  # reset sets the game before it acquires the engine
            self.world.release(self.game, self._env)
            self._env = None

    # -- the reference action -------------------------------------------------------------
    def _follow_plan(self, command: str, facts_before: frozenset) -> None:
        key = fb.state_key(self.now.facts)
        if self.plan_pos is not None and self.plan_pos < len(self.plan) and command == self.plan[self.plan_pos]:
            self.plan_pos += 1
            self._plan_states.setdefault(key, self.plan_pos)
        elif self.now.facts != facts_before:
            self.plan_pos = self._plan_states.get(key)  # back on a state the plan passed through, or strayed

    def expert_action(self) -> str | None:
        if self.done:
            return None
        if self.plan_pos is not None and self.plan_pos < len(self.plan):
            return self.plan[self.plan_pos]
        return self._handcoded_next

    def _result(self, reward: float, feedback: Feedback, info: dict) -> Step:
        info = {
            "turn": self.turns,
            "won": self.now.won,
            "task_type": self.task_type,
            "on_plan": self.plan_pos is not None,
            **info,
        }
        return Step(
            observation=self.now.observation,
            reward=float(reward),
            done=self.done,
            feedback=feedback,
            admissible_actions=[] if self.done else list(self.now.admissible),
            state_key=fb.state_key(self.now.facts),
            expert_action=self.expert_action(),
            info=info,
        )
