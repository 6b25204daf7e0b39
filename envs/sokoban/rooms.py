"""Sokoban rooms: the level itself, its text form, and a seeded generator.

A room is a rectangle of cells indexed flat (``cell = row * width + col``), closed by
walls on its border, so a step never needs a bounds check: one cell beyond any floor cell
is still inside the grid.

The generator is gym-sokoban's reverse play (Schrader, 2018) as TextArena 0.7.4 runs it
(``textarena.envs.Sokoban.utils.generate_room``): carve the floor by a random walk that
stamps small masks, put the player and every box (on its goal) on random floor cells,
then search backwards (the player walks and pulls boxes) and keep the position that
scores best. A pulled position is solvable by construction: every pull undone is a push.
TextArena then drops a room whose box starts between two walls (its corner test counts
opposite walls as a corner); serl keeps that filter too, so its rooms follow TextArena's
distribution, which docs/ENVS.md's measurements were made on. On 20,000 seeds each, the
two generators' 6x6 one-box rooms agree in shortest-solution histogram within sampling
noise (52.6 % vs 52.8 % of rooms need 4+ moves), and the reverse search returns exactly
TextArena's position on the same carved room.

The code is serl's own, on ``random.Random(seed)`` in pure stdlib, rather than a
dependency on TextArena, whose package requires openai, rich, nltk, chess, python-dotenv,
requests and websockets, and whose generator draws from numpy's generator besides
``random`` and keeps its search in module globals. A room here is a pure function of its
seed and settings, identical on every machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import cached_property

WALL, FLOOR, GOAL, BOX, BOX_ON_GOAL, PLAYER, PLAYER_ON_GOAL = "#", "_", "G", "B", "*", "P", "+"
DIRECTIONS = ("up", "down", "left", "right")  # also the order the expert breaks ties in

# gym-sokoban's floor stamps, centred on the walker: a bar, a column, two L-shapes, a block.
_MASKS = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
_HEADINGS = ((1, 0), (0, 1), (-1, 0), (0, -1))  # the walker's (row, col) directions
_P_TURN = 0.35  # gym-sokoban: chance the walker picks a new direction at each step
_SEARCH_DEPTH, _SEARCH_STATES = 300, 300_000  # gym-sokoban's limits on the reverse play's search


@dataclass(frozen=True)
class Room:
    """A level: fixed walls and goals, and where the boxes and the player start."""

    width: int
    height: int
    walls: frozenset[int]
    goals: frozenset[int]
    boxes: frozenset[int]
    player: int

    @cached_property
    def steps(self) -> dict[str, int]:
        """How far each direction moves in flat cell indices."""
        return {"up": -self.width, "down": self.width, "left": -1, "right": 1}

    def row_col(self, cell: int) -> tuple[int, int]:
        return divmod(cell, self.width)

    @cached_property
    def _background(self) -> tuple[str, ...]:
        return tuple(
            WALL if c in self.walls else GOAL if c in self.goals else FLOOR for c in range(self.width * self.height)
        )

    def render(self, player: int, boxes: frozenset[int]) -> str:
        """The grid one row per line, cells separated by spaces (one token each for a BPE tokenizer)."""
        cells = list(self._background)
        for b in boxes:
            cells[b] = BOX_ON_GOAL if b in self.goals else BOX
        cells[player] = PLAYER_ON_GOAL if player in self.goals else PLAYER
        w = self.width
        return "\n".join(" ".join(cells[i : i + w]) for i in range(0, len(cells), w))

    def __str__(self) -> str:
        return self.render(self.player, self.boxes)


def parse_room(text: str) -> Room:
    """A room from its grid text (as ``render`` writes it; spaces between cells are optional)."""
    rows = [line.replace(" ", "") for line in text.strip().splitlines()]
    width, height = len(rows[0]), len(rows)
    if any(len(r) != width for r in rows):
        raise ValueError("a room's rows must all have the same width")
    cells = "".join(rows)
    unknown = set(cells) - {WALL, FLOOR, GOAL, BOX, BOX_ON_GOAL, PLAYER, PLAYER_ON_GOAL}
    if unknown:
        raise ValueError(f"unknown room symbols {sorted(unknown)}")
    border = [i for i in range(len(cells)) if i < width or i >= len(cells) - width or i % width in (0, width - 1)]
    if any(cells[i] != WALL for i in border):
        raise ValueError("a room must be closed by walls on its border")

    def where(*symbols: str) -> frozenset[int]:
        return frozenset(i for i, s in enumerate(cells) if s in symbols)

    players = where(PLAYER, PLAYER_ON_GOAL)
    room = Room(
        width,
        height,
        walls=where(WALL),
        goals=where(GOAL, BOX_ON_GOAL, PLAYER_ON_GOAL),
        boxes=where(BOX, BOX_ON_GOAL),
        player=min(players, default=-1),
    )
    if len(players) != 1 or not room.boxes or len(room.boxes) != len(room.goals):
        raise ValueError("a room needs one player, at least one box, and as many goals as boxes")
    return room


# -- the rules of motion ----------------------------------------------------------------------
WALKED_INTO_WALL, BOX_HITS_WALL, BOX_HITS_BOX, MOVED, PUSHED = "wall", "box-wall", "box-box", "moved", "pushed"


def move(room: Room, player: int, boxes: frozenset[int], step: int) -> tuple[str, int, frozenset[int]]:
    """One move of the player by ``step`` cells: (outcome, player, boxes) after it.

    A box ahead is pushed when the cell beyond it is free; otherwise nothing moves. The one
    statement of the game's rules: episodes and the solver both step through it.
    """
    ahead = player + step
    if ahead in room.walls:
        return WALKED_INTO_WALL, player, boxes
    if ahead not in boxes:
        return MOVED, ahead, boxes
    beyond = ahead + step
    if beyond in room.walls:
        return BOX_HITS_WALL, player, boxes
    if beyond in boxes:
        return BOX_HITS_BOX, player, boxes
    return PUSHED, ahead, boxes - {ahead} | {beyond}


# -- generation -----------------------------------------------------------------------------
def generate_room(rng: random.Random, size: int, num_boxes: int, gen_steps: int) -> Room | None:
    """One attempt at a ``size`` x ``size`` room carved by ``gen_steps`` walker steps; None when
    it gave nothing usable."""
    floor = _carve(rng, size, gen_steps)
    if len(floor) < num_boxes + 2:  # the boxes, the player, and room to move
        return None
    walls = frozenset(range(size * size)) - frozenset(floor)
    player = rng.choice(floor)
    goals = rng.sample([c for c in floor if c != player], num_boxes)
    start = _reverse_play(size, walls, goals, player)
    if start is None:
        return None
    player, boxes = start
    if any(_between_walls(b, walls, size) for b in boxes):
        return None
    return Room(size, size, walls=walls, goals=frozenset(goals), boxes=boxes, player=player)


def _carve(rng: random.Random, size: int, steps: int) -> list[int]:
    """Floor cells, sorted: a walk of ``steps`` steps stamping a random mask at each."""
    floor: set[int] = set()
    r, c = rng.randint(1, size - 1), rng.randint(1, size - 1)  # gym-sokoban's range; the first step clamps it
    dr, dc = rng.choice(_HEADINGS)
    for _ in range(steps):
        if rng.random() < _P_TURN:
            dr, dc = rng.choice(_HEADINGS)
        r, c = min(max(r + dr, 1), size - 2), min(max(c + dc, 1), size - 2)
        mask = rng.choice(_MASKS)
        floor.update((r + i - 1) * size + (c + j - 1) for i in range(3) for j in range(3) if mask[i][j])
    return sorted(cell for cell in floor if 0 < cell // size < size - 1 and 0 < cell % size < size - 1)  # border: wall


def _between_walls(cell: int, walls: frozenset[int], width: int) -> bool:
    """Walls on two opposite sides: TextArena's corner test takes that for a corner.

    (It counts walls up and down, or left and right, as adjacent.) A pulled box always has
    free cells on both sides along its last pull, so this is exactly what that test rejects.
    """
    return (cell - width in walls and cell + width in walls) or (cell - 1 in walls and cell + 1 in walls)


def _reverse_play(
    width: int, walls: frozenset[int], goals: list[int], player: int
) -> tuple[int, frozenset[int]] | None:
    """gym-sokoban's reverse play: a depth-first search of the player's walks and pulls from the solved room.

    Each position is scored once, on first visit, as pulls along the search path x the
    boxes' summed distance from their own goals, and counts only while every goal is empty
    (no box, and no player, on it). Returns the best-scoring position (player, boxes), the
    first found among equals; None when none scored. The search's order (up, down, left,
    right) and limits are gym-sokoban's, and so is what makes a position new: gym-sokoban
    hashes its grid, where a box never pulled is marked apart from one pulled back onto
    its goal. Its choices are therefore the same on the same room and player.
    """
    steps = (-width, width, -1, 1)
    explored: set[tuple[int, frozenset[int], frozenset[int]]] = set()
    best, best_score = None, 0
    # (player, box -> the goal it started on, boxes never pulled, pulls on this path, depth left)
    stack = [(player, {g: g for g in goals}, frozenset(goals), 0, _SEARCH_DEPTH)]
    while stack:
        player, origin, unpulled, pulls, ttl = stack.pop()
        ttl -= 1
        boxes = frozenset(origin)
        if ttl <= 0 or len(explored) >= _SEARCH_STATES or (player, boxes, unpulled) in explored:
            continue
        explored.add((player, boxes, unpulled))
        if player not in goals and boxes.isdisjoint(goals):
            score = pulls * sum(abs(b // width - g // width) + abs(b % width - g % width) for b, g in origin.items())
            if score > best_score:
                best, best_score = (player, boxes), score
        for step in reversed(steps):  # a stack: pushed last, searched first
            ahead, behind = player + step, player - step
            if ahead in walls or ahead in origin:
                continue
            if behind in origin:  # pull the box behind into the cell the player leaves
                pulled = dict(origin)
                pulled[player] = pulled.pop(behind)
                stack.append((ahead, pulled, unpulled - {behind}, pulls + 1, ttl))
            else:
                stack.append((ahead, origin, unpulled, pulls, ttl))
    return best
