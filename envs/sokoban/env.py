"""The Sokoban environment: a world of seeded rooms and cheap episodes (protocol: ``envs.base``).

The observation is the room's grid (legend in ``RULES``); the four moves are always
admissible. Each step's :class:`~envs.base.Feedback`:

* ``error``: why the move did nothing (a wall, a box that cannot move, an unknown action),
  and also the deadlock, when this push made the room unsolvable. The push did happen,
  but it is the mistake that lost the episode, which is what ``error`` flags for SERL; so
  ``info["invalid"]`` stays False for it, while serl's ``invalid_actions`` count (any
  turn with an error) includes it.
* ``diff``: what moved ("player moved up", "pushed a box up; box is now on a goal", the
  deadlock), or "no change".

A deadlock is announced once, on the push that turned a solvable room unsolvable (the
solver decides; ``envs.sokoban.solver.deadlock_reason`` names the simplest reason).
Reward is 1.0 on the move that puts every box on a goal; the turn limit ends the episode
with reward 0. ``info["won"]`` is what serl scores as success.

Splits: test room i comes from seed i (a fixed panel of 500), train room i from seed
1,000,000 + i (100,000 of them); a seed whose room needs fewer than ``min_solution`` moves
draws again from the same random stream. Disjoint seeds are not disjoint rooms: at 6x6
with one box the generator knows only a few thousand rooms (3,485 distinct among the
10,528 kept from 20,000 seeds), so about a quarter of train rooms also appear in the test
panel (and the panel holds 436 distinct rooms), as in other TextArena-based setups. A
claim about unseen rooms needs more room: at ``size=7, boxes=2`` 1 % of train rooms are
test rooms; or ``disjoint_rooms``: a train seed whose room is one of the test panel's (the
same walls, goals, boxes and player) draws again from its own stream until it is not, so the
train split holds no panel room and every other train task keeps its room (docs/SOKOBAN.md
has the counts).
"""

from __future__ import annotations

import random
import re
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

from envs.base import ActionFormat, EnvError, Feedback, Step, state_key
from envs.sokoban import authors
from envs.sokoban.rooms import (
    BOX_HITS_BOX,
    BOX_HITS_WALL,
    DIRECTIONS,
    MOVED,
    WALKED_INTO_WALL,
    Room,
    generate_room,
    move,
)
from envs.sokoban.solver import CORNER, DEAD_WALL, UNSOLVABLE, Solver, State, deadlock_reason

INSTRUCTION = "Push every box onto a goal."
RULES = """You are playing Sokoban in a room seen from above. Each turn you see the room, one row per line:
# wall, _ floor, G goal, B box, * box on a goal, P you, + you on a goal.
Rows and columns are counted from 0 at the top left.
Act with exactly one move per turn: up, down, left or right.
Walking into a box pushes it one cell, if the cell beyond it is floor or a goal; boxes can never be pulled.
You win when every box is on a goal. A box pushed into a corner, or against a wall with no goal
along it, can never reach a goal again."""
ACTION_FORMAT = ActionFormat(example="up", bare=re.compile(r"up|down|left|right", re.IGNORECASE))

NEW_ROOM, NO_CHANGE = "new room", "no change"
BLOCKED = {
    WALKED_INTO_WALL: "you walked into a wall",
    BOX_HITS_WALL: "the box can't move: wall behind it",
    BOX_HITS_BOX: "the box can't move: another box behind it",
}
ON_GOAL, OFF_GOAL, SOLVED = "box is now on a goal", "box left a goal", "every box is on a goal"

# Test room i comes from seed i, train room i from seed 1,000,000 + i: the seed ranges never meet.
SPLITS = {"train": (1_000_000, 100_000), "test": (0, 500)}  # split -> (first seed, number of rooms)
MAX_ATTEMPTS = 1_000  # rooms generated for one seed before the settings are called impossible
CACHED_LEVELS = 4_096  # rooms kept with their solver tables (a 6x6 one-box room: about 10 KB)


@dataclass
class SokobanConfig:
    size: int = 6  # the square room's side, walls included
    boxes: int = 1
    max_turns: int = 15
    min_solution: int = 4  # keep only rooms whose shortest solution takes at least this many moves
    gen_steps: int | None = None  # steps of the walk that carves the room; None: TextArena's 1.7 x 2 x size (20 at 6)
    # a deadlocking push ends the episode (reward 0): no later move can win the room, so the turns after it
    # only fill the turn limit. Success is the same either way; what changes is what an update trains on
    end_on_deadlock: bool = False
    # the train split holds no room of the test panel, compared by the room itself (walls, goals, boxes, player),
    # not by seed: at 6x6 the seeds are disjoint but a quarter of train rooms are panel rooms, so a test score
    # says nothing about unseen rooms. The test panel is the same either way
    disjoint_rooms: bool = False

    def check(self) -> None:
        limits = {"size": 4, "boxes": 1, "max_turns": 1, "min_solution": 1, "gen_steps": 1}
        for name, least in limits.items():
            value = getattr(self, name)
            if value is not None and value < least:
                raise EnvError(f"Sokoban setting {name} must be at least {least}, got {value}")

    @property
    def carve_steps(self) -> int:
        return self.gen_steps or int(1.7 * 2 * self.size)


class SokobanWorld:
    """The rooms of each split, generated on demand from their seeds and cached with their solvers."""

    name = "sokoban"
    rules = RULES
    eval_split = "test"
    action_format = ACTION_FORMAT
    authors_prompt = authors.PROMPT  # prompt.style authors (envs.authors)
    model_preset = "micro"  # serl's embedded default model: 0.9M parameters learn a 6x6 room in minutes

    def __init__(self, config: SokobanConfig | None = None):
        self.config = config or SokobanConfig()
        self.config.check()
        self._levels: OrderedDict[tuple[str, int], Solver] = OrderedDict()

    def splits(self) -> list[str]:
        return list(SPLITS)

    def num_tasks(self, split: str) -> int:
        return self._split(split)[1]

    def level(self, split: str, task_id: int) -> Solver:
        """Task ``task_id``'s room with its solver table; the least recently used are dropped past CACHED_LEVELS."""
        key = (split, task_id)
        if key in self._levels:
            self._levels.move_to_end(key)
            return self._levels[key]
        first_seed, n = self._split(split)
        if not 0 <= task_id < n:
            raise EnvError(f"task id {task_id} out of range: Sokoban split {split!r} has tasks 0..{n - 1}")
        excluded = self.test_rooms if split == "train" and self.config.disjoint_rooms else frozenset()
        level = self._levels[key] = self._generate(first_seed + task_id, excluded)
        if len(self._levels) > CACHED_LEVELS:
            self._levels.popitem(last=False)
        return level

    def room(self, split: str, task_id: int) -> Room:
        return self.level(split, task_id).room

    @cached_property
    def test_rooms(self) -> frozenset[Room]:
        """Every room of the test panel (``disjoint_rooms`` keeps them out of train): generated once per
        world, about 0.3 CPU seconds at 6x6."""
        return frozenset(self._generate(SPLITS["test"][0] + i).room for i in range(SPLITS["test"][1]))

    def corpus_texts(self) -> list[str]:
        """Every feedback phrase, for the tokenizer: the expert episodes it also reads never bump or
        deadlock. And each move alone, a bare reply: one token each, so that no update can split a
        move in two (a tokenizer that writes "right" as "r" + "ight" lets RL teach "r" + "down")."""
        cells = [(r, c) for r in range(self.config.size) for c in range(self.config.size)]
        return [
            *DIRECTIONS,
            *BLOCKED.values(),
            NEW_ROOM,
            NO_CHANGE,
            ON_GOAL,
            OFF_GOAL,
            SOLVED,
            UNSOLVABLE,
            *(f"{verb} {d}" for verb in ("player moved", "pushed a box") for d in DIRECTIONS),
            *(t.format(row=r, col=c) for t in (CORNER, DEAD_WALL) for r, c in cells),
        ]

    def new_episode(self, split: str = "test", max_turns: int | None = None) -> SokobanEpisode:
        self._split(split)  # validate the split name early
        return SokobanEpisode(self, split, max_turns or self.config.max_turns)

    def _split(self, split: str) -> tuple[int, int]:
        if split not in SPLITS:
            raise EnvError(f"unknown Sokoban split {split!r}: choose one of {', '.join(SPLITS)}")
        return SPLITS[split]

    def _generate(self, seed: int, excluded: frozenset[Room] = frozenset()) -> Solver:
        """The first room drawn from ``random.Random(seed)`` whose shortest solution is long enough
        and that is none of ``excluded``.

        A rejected room's attempt simply continues the same random stream, so the room
        of a seed depends on the seed and the settings alone.
        """
        cfg = self.config
        rng = random.Random(seed)
        for _ in range(MAX_ATTEMPTS):
            room = generate_room(rng, cfg.size, cfg.boxes, cfg.carve_steps)
            if room is None or room in excluded:
                continue
            level = Solver(room)
            if (level.distance(level.start) or 0) >= cfg.min_solution:
                return level
        raise EnvError(
            f"no Sokoban room with a solution of {cfg.min_solution}+ moves in {MAX_ATTEMPTS} attempts "
            f"(seed {seed}, size {cfg.size}, {cfg.boxes} boxes): lower min_solution or raise gen_steps"
        )


class SokobanEpisode:
    """One room being played: its solver table, the player and boxes, and the turn count."""

    def __init__(self, world: SokobanWorld, split: str, max_turns: int):
        self.world, self.split, self.max_turns = world, split, max_turns
        self.task_id = -1
        self.instruction = INSTRUCTION
        self.level: Solver | None = None
        self.state: State = (-1, frozenset())
        self.turns = 0
        self.done = True
        self.solvable = True

    # -- protocol -------------------------------------------------------------------------
    def reset(self, task_id: int) -> Step:
        level = self.world.level(self.split, task_id)
        self.task_id = task_id
        return self._begin(level)

    def play(self, room: Room) -> Step:
        """Start on a room of one's own (a hand-drawn one, say) instead of a task of the split."""
        self.task_id = -1
        return self._begin(Solver(room))

    def step(self, action: str) -> Step:
        if self.done:
            raise EnvError("the episode is over: reset it before stepping")
        feedback, deadlock = self._apply(action)
        self.turns += 1
        won = self.state[1] == self.room.goals
        truncated = not won and self.turns >= self.max_turns
        self.done = won or truncated or (deadlock is not None and self.world.config.end_on_deadlock)
        invalid = feedback.error is not None and deadlock is None
        return self._result(
            1.0 if won else 0.0, feedback, {"truncated": truncated, "invalid": invalid, "deadlock": deadlock}
        )

    def admissible_actions(self) -> list[str]:
        return [] if self.done else list(DIRECTIONS)

    def expert_action(self) -> str | None:
        """The first of the shortest solution's moves (up/down/left/right order); None once over or unsolvable."""
        return None if self.done else self._solver.expert_action(self.state)

    def optimal_actions(self) -> list[str]:
        """Every first move of a shortest solution (``expert_action`` is the first of them):
        a noisy expert spreads its demonstrations over these, so that a learner is not
        taught the solver's tie-break as if it were part of the game."""
        return [] if self.done else sorted(self._solver.optimal_actions(self.state), key=DIRECTIONS.index)

    def solvable_actions(self) -> list[str]:
        """The moves after which the room can still be solved (a bump moves nothing, so it is one).

        A noisy expert draws its exploration moves from these, so that its data reaches
        states off the expert's path without throwing the episode away.
        """
        if self.done or not self.solvable:
            return []
        return [
            a
            for a in DIRECTIONS
            if self._solver.distance(move(self.room, *self.state, self.room.steps[a])[1:]) is not None
        ]

    @property
    def room(self) -> Room:
        return self._solver.room

    @property
    def _solver(self) -> Solver:
        """The room's solver. Set by reset or play; what reads it runs only after them (a method
        a finished episode may be asked first checks ``done``, which is True until then)."""
        if self.level is None:
            raise EnvError("no room yet: reset the episode first")
        return self.level

    # -- mechanics ------------------------------------------------------------------------
    def _begin(self, level: Solver) -> Step:
        self.level, self.state = level, level.start
        self.turns, self.done = 0, False
        self.solvable = level.distance(level.start) is not None
        return self._result(0.0, Feedback(diff=NEW_ROOM), {"truncated": False, "invalid": False, "deadlock": None})

    def _apply(self, action: str) -> tuple[Feedback, str | None]:
        """Move for a valid action; (feedback, the deadlock this move caused or None)."""
        name = action.strip().lower()
        step = self.room.steps.get(name)
        if step is None:
            shown = action if len(action) <= 40 else action[:37] + "..."
            return Feedback(error=f"unknown action {shown!r}: expected up, down, left or right", diff=NO_CHANGE), None
        outcome, player, boxes = move(self.room, *self.state, step)
        if outcome in BLOCKED:
            return Feedback(error=BLOCKED[outcome], diff=NO_CHANGE), None
        before, self.state = self.state[1], (player, boxes)
        if outcome == MOVED:
            return Feedback(diff=f"player moved {name}"), None
        return self._pushed(name, before, boxes)

    def _pushed(self, direction: str, before: frozenset[int], after: frozenset[int]) -> tuple[Feedback, str | None]:
        """Describe a push; name the deadlock when it made the room unsolvable."""
        (src,), (dst,) = before - after, after - before
        goals = self.room.goals
        said = [f"pushed a box {direction}"]
        if dst in goals:
            said.append(ON_GOAL)
        elif src in goals:
            said.append(OFF_GOAL)
        if after == goals:
            said.append(SOLVED)
        deadlock = None
        if self.solvable and self._solver.distance(self.state) is None:
            self.solvable, deadlock = False, deadlock_reason(self.room, dst)
            said.append(deadlock)
        return Feedback(error=deadlock, diff="; ".join(said)), deadlock

    def _result(self, reward: float, feedback: Feedback, info: dict) -> Step:
        obs = self.room.render(*self.state)
        won = self.state[1] == self.room.goals
        info = {
            "turn": self.turns,
            "won": won,
            "solvable": self.solvable,
            "boxes_on_goals": len(self.state[1] & self.room.goals),
            **info,
        }
        return Step(
            obs, reward, self.done, feedback, self.admissible_actions(), state_key(obs), self.expert_action(), info
        )
