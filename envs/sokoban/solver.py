"""Exact Sokoban solving for small rooms, and the deadlocks the environment can name.

A :class:`Solver` explores every state (player cell, box cells) reachable from a room's
start by single moves, then runs one breadth-first search backwards from the solved
states. Afterwards the shortest distance to a solution of any state an episode can reach
is a dict lookup: the expert's action, the set of optimal actions, and whether a push just
made the room unsolvable all cost microseconds. Distances count moves, not pushes, because
an episode's turn budget counts moves.

States where a box stands on a dead square (no goal reachable from it even with every
other box gone) are not explored: they are unsolvable, and a state absent from the table
is exactly that. A 6x6 test room with one box has 8 to 122 solvable states (median 40)
and its table takes about 0.1 ms; the count grows as floor x C(floor, boxes), so the
exact table is meant for the small rooms serl trains on, and refuses rooms past
``MAX_STATES``.
"""

from __future__ import annotations

from envs.sokoban.rooms import DIRECTIONS, MOVED, PUSHED, Room, move

State = tuple[int, frozenset[int]]  # (player cell, box cells)
MAX_STATES = 1_000_000


class Solver:
    """Shortest solutions, in moves, from every state reachable from ``room``'s start."""

    def __init__(self, room: Room):
        self.room = room
        self.start: State = (room.player, room.boxes)
        self.dead = dead_squares(room)
        self._steps = [(d, room.steps[d]) for d in DIRECTIONS]
        self._distance = self._distances()
        self._expert: dict[State, str | None] = {}

    # -- queries ----------------------------------------------------------------------------
    def distance(self, state: State) -> int | None:
        """Moves to a solution from ``state`` (a state reachable from the start); None when unsolvable."""
        return self._distance.get(state)

    def optimal_actions(self, state: State) -> set[str]:
        """Every first move of a shortest solution from ``state`` (empty when solved or unsolvable)."""
        d = self._distance.get(state)
        if not d:
            return set()
        return {name for name, nxt in self._successors(state) if self._distance.get(nxt) == d - 1}

    def expert_action(self, state: State) -> str | None:
        """One optimal action, the first in up/down/left/right order; cached by state."""
        if state not in self._expert:
            best = self.optimal_actions(state)
            self._expert[state] = next((d for d in DIRECTIONS if d in best), None)
        return self._expert[state]

    def solve(self, state: State | None = None) -> list[str] | None:
        """A shortest plan from ``state`` (default: the start); None when there is none."""
        state = self.start if state is None else state
        if self.distance(state) is None:
            return None
        plan = []
        while (action := self.expert_action(state)) is not None:
            plan.append(action)
            _, player, boxes = move(self.room, *state, self.room.steps[action])
            state = (player, boxes)
        return plan

    # -- the table ---------------------------------------------------------------------------
    def _successors(self, state: State) -> list[tuple[str, State]]:
        """(action, next state) for each move that changes something."""
        out = []
        for name, step in self._steps:
            outcome, player, boxes = move(self.room, *state, step)
            if outcome in (MOVED, PUSHED):
                out.append((name, (player, boxes)))
        return out

    def _distances(self) -> dict[State, int]:
        """Explore forwards from the start, then search backwards from every solved state."""
        goals = self.room.goals
        states, index, solved = [self.start], {self.start: 0}, []
        parents: list[list[int]] = [[]]  # by state index: the indices of the states one move before it
        for i, state in enumerate(states):  # the list grows while it is read: a BFS queue
            if state[1] == goals:
                solved.append(i)  # an episode ends here: no moves out
                continue
            for _, nxt in self._successors(state):
                if not nxt[1].isdisjoint(self.dead):
                    continue
                j = index.get(nxt)
                if j is None:
                    if len(states) >= MAX_STATES:
                        raise ValueError(f"room too large for the exact solver (over {MAX_STATES} states)")
                    j = index[nxt] = len(states)
                    states.append(nxt)
                    parents.append([])
                parents[j].append(i)
        distance = dict.fromkeys(solved, 0)
        frontier = solved
        while frontier:
            nxt_frontier = []
            for j in frontier:
                for i in parents[j]:
                    if i not in distance:
                        distance[i] = distance[j] + 1
                        nxt_frontier.append(i)
            frontier = nxt_frontier
        return {states[i]: d for i, d in distance.items()}


# -- deadlocks -------------------------------------------------------------------------------
def dead_squares(room: Room) -> frozenset[int]:
    """Floor cells from which a lone box can never be pushed onto any goal.

    Found backwards: a box reaches ``cell`` from ``cell - step`` when the player can stand
    at ``cell - 2 * step``; every cell so reached from a goal is live, the rest are dead.
    """
    live, frontier = set(room.goals), list(room.goals)
    while frontier:
        cell = frontier.pop()
        for step in room.steps.values():
            source = cell - step
            if source not in live and source not in room.walls and source - step not in room.walls:
                live.add(source)
                frontier.append(source)
    return frozenset(range(room.width * room.height)) - room.walls - live


CORNER = "deadlock: box pushed into a corner at row {row} col {col}"
DEAD_WALL = "deadlock: box pushed against a wall with no goal along it at row {row} col {col}"
UNSOLVABLE = "deadlock: the level can no longer be solved"


def deadlock_reason(room: Room, box: int) -> str:
    """Why the room became unsolvable when a box was pushed onto ``box``: the simplest true reason.

    Call it only once the solver has found the room unsolvable: a corner or a dead wall
    is named where the pushed box stands in one, the solver's verdict otherwise (two
    boxes frozen against each other, a box shut in a corridor).
    """
    row, col = room.row_col(box)
    if box not in room.goals and is_corner(box, room.walls, room.width):
        return CORNER.format(row=row, col=col)
    if box not in room.goals and _against_dead_wall(room, box):
        return DEAD_WALL.format(row=row, col=col)
    return UNSOLVABLE


def is_corner(cell: int, walls: frozenset[int], width: int) -> bool:
    """Walls on two sides at right angles: a box there can never move again."""
    return (cell - width in walls or cell + width in walls) and (cell - 1 in walls or cell + 1 in walls)


def _against_dead_wall(room: Room, cell: int) -> bool:
    """The box can only slide along a wall whose two ends are closed, and no goal lies on that stretch."""
    w = room.width
    for side, along in ((-w, 1), (w, 1), (-1, w), (1, w)):
        if cell + side in room.walls and _closed(room, cell, side, along) and _closed(room, cell, side, -along):
            return True
    return False


def _closed(room: Room, cell: int, side: int, along: int) -> bool:
    """Walking from ``cell`` by ``along``, the wall at ``side`` runs unbroken to an end wall, past no goal."""
    while cell not in room.walls:
        if cell in room.goals or cell + side not in room.walls:
            return False
        cell += along
    return True
