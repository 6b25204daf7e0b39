"""ALFWorld feedback from the game state, as pure functions over facts.

A state is a set of facts, each a tuple ``(predicate, arg, ...)`` in the game's readable
names, e.g. ``("inreceptacle", "apple 1", "fridge 1")``. TextWorld's PDDL state also keeps
``not_*`` facts (negations that pile up with history) and ``checked`` marks; only the
positive facts are the world's state, so only they are kept (:func:`positive_facts`).

* :func:`parse_command`: a command string -> (verb, arguments), or why it is malformed.
* :func:`why_inadmissible`: why a well-formed command does nothing here (ALFWorld itself
  only says "Nothing happens.").
* :func:`describe_change`: the ``diff`` feedback: location, inventory, containers opened or
  closed, objects moved, objects heated, cooled, cleaned, switched on or sliced.
* :func:`state_key`: a hash of the world state.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

Fact = tuple  # (predicate, *argument names)

COMMANDS = {  # verb -> the command's pattern (ALFWorld 2.1.1 templates, alfred.twl2)
    "go to": re.compile(r"go to (?P<r>.+)"),
    "take": re.compile(r"take (?P<o>.+?) from (?P<r>.+)"),
    "put": re.compile(r"put (?P<o>.+?) in/on (?P<r>.+)"),
    "open": re.compile(r"open (?P<r>.+)"),
    "close": re.compile(r"close (?P<r>.+)"),
    "toggle": re.compile(r"toggle (?P<o>.+)"),
    "heat": re.compile(r"heat (?P<o>.+?) with (?P<r>.+)"),
    "cool": re.compile(r"cool (?P<o>.+?) with (?P<r>.+)"),
    "clean": re.compile(r"clean (?P<o>.+?) with (?P<r>.+)"),
    "slice": re.compile(r"slice (?P<o>.+?) with (?P<k>.+)"),
    "use": re.compile(r"use (?P<o>.+)"),
    "examine": re.compile(r"examine (?P<o>.+)"),
    "look": re.compile(r"look"),
    "inventory": re.compile(r"inventory"),
}
COMMAND_HELP = (
    "go to X, take X from Y, put X in/on Y, open X, close X, toggle X, heat X with Y, "
    "cool X with Y, clean X with Y, slice X with Y, use X, examine X, look, inventory"
)
STATE_WORDS = {"ishot": "hot", "iscool": "cool", "isclean": "clean", "istoggled": "switched on", "issliced": "sliced"}
START = "the middle of the room"  # where the agent starts: a location no receptacle is at


def normalize(command: str) -> str:
    """Case and runs of whitespace do not matter: ``Go to  Desk 1`` is ``go to desk 1``."""
    return " ".join(command.lower().split())


def shown(text: str, limit: int = 60) -> str:
    return repr(text if len(text) <= limit else text[: limit - 3] + "...")


def parse_command(command: str) -> tuple[str | None, dict[str, str], str | None]:
    """(verb, arguments, error): the command matched against ALFWorld's templates."""
    cmd = normalize(command)
    if not cmd:
        return None, {}, "empty command: " + "expected one of " + COMMAND_HELP
    for verb, pattern in COMMANDS.items():
        m = pattern.fullmatch(cmd)
        if m:
            return verb, m.groupdict(), None
    if re.match(r"put .+ (in|on|into|onto) ", cmd):
        return None, {}, f"unparseable command {shown(command)}: ALFWorld writes it 'put X in/on Y'"
    return None, {}, f"unparseable command {shown(command)}: expected one of {COMMAND_HELP}"


# ``checked``: set by look, inventory, examine and open, and a precondition of no action
# (alfred.pddl): a record of what the agent looked at, not of the world.
BOOKKEEPING = ("not_", "checked")


def positive_facts(facts) -> frozenset[Fact]:
    """TextWorld propositions -> the world's state: positive facts, bookkeeping left out."""
    return frozenset((f.name, *f.names) for f in facts if not f.name.startswith(BOOKKEEPING))


def state_key(facts: frozenset[Fact]) -> str:
    """The world state's hash: ALFWorld's observation answers the last command ("Nothing
    happens." in any state), so it cannot tell states apart; the facts can."""
    text = "\n".join(sorted(" ".join(f) for f in facts))
    return hashlib.sha1(text.encode("utf-8")).hexdigest()[:16]


def _index(facts: frozenset[Fact], predicate: str) -> dict[str, str]:
    return {f[1]: f[2] for f in facts if f[0] == predicate and len(f) == 3}


def where_agent_is(facts: frozenset[Fact]) -> str:
    """The receptacle(s) at the agent's location, or the start of the room."""
    loc = next((f[2] for f in facts if f[0] == "atlocation"), None)
    here = sorted(f[1] for f in facts if f[0] == "receptacleatlocation" and f[2] == loc)
    return " / ".join(here) if here else START


def holding(facts: frozenset[Fact]) -> list[str]:
    return sorted(f[2] for f in facts if f[0] == "holds")


def entities(facts: frozenset[Fact]) -> set[str]:
    return {f[1] for f in facts if f[0] in ("objecttype", "receptacletype")}


def describe_change(before: frozenset[Fact], after: frozenset[Fact]) -> str:
    """The ``diff`` feedback between two states; "no change" when they are the same."""
    notes = []
    was, now = where_agent_is(before), where_agent_is(after)
    if was != now or ({f for f in before if f[0] == "atlocation"} != {f for f in after if f[0] == "atlocation"}):
        notes.append(f"location: {was} -> {now}")
    held_before, held_after = set(holding(before)), set(holding(after))
    notes += [f"picked up {o}" for o in sorted(held_after - held_before)]
    notes += [f"no longer holding {o}" for o in sorted(held_before - held_after)]
    opened_before = {f[1] for f in before if f[0] == "opened"}
    opened_after = {f[1] for f in after if f[0] == "opened"}
    notes += [f"{r} opened" for r in sorted(opened_after - opened_before)]
    notes += [f"{r} closed" for r in sorted(opened_before - opened_after)]
    in_before, in_after = _index(before, "inreceptacle"), _index(after, "inreceptacle")
    for obj in sorted(in_before.keys() | in_after.keys()):
        a, b = in_before.get(obj), in_after.get(obj)
        if a != b:
            if b is None:
                notes.append(f"{obj} left {a}")
            else:
                notes.append(f"{obj} now in/on {b}" + (f" (was in/on {a})" if a else ""))
    for pred, word in STATE_WORDS.items():
        gained = sorted(f[1] for f in after - before if f[0] == pred)
        lost = sorted(f[1] for f in before - after if f[0] == pred)
        notes += [f"{o} is now {word}" for o in gained] + [f"{o} is no longer {word}" for o in lost]
    return "; ".join(notes) if notes else "no change"


def why_inadmissible(verb: str, args: dict[str, str], facts: frozenset[Fact]) -> str:
    """Why a well-formed command does nothing in this state (the first reason found)."""
    known = entities(facts)
    for name in args.values():
        if name not in known:
            return f"there is no {name!r} here"
    scene = _Scene.of(facts)
    # a branch below reads only the arguments its verb's pattern names, so the "" default never shows
    o, r = args.get("o", ""), args.get("r", "")
    if verb == "go to":
        return _why_not_go_to(r, scene)
    if verb in ("open", "close"):
        return _why_not_open_or_close(verb, r, scene)
    if verb == "take":
        return _why_not_take(o, r, scene)
    if verb in ("put", "heat", "cool", "clean"):
        return _why_not_put_or_apply(verb, o, r, scene)
    if verb in ("use", "toggle"):
        return f"{o} is not here" if scene.loc_of_obj.get(o) != scene.agent_loc else f"{o} cannot be used"
    if verb == "examine":
        return f"{o} is not here"
    if verb == "slice":
        return f"you need to hold {args.get('k')} and be where {o} is"
    return "the game does not accept it here"


@dataclass(frozen=True)
class _Scene:
    """What a command's preconditions read of a state: where the agent, the receptacles and the
    objects are, what the agent holds, and which receptacles open and are open."""

    facts: frozenset[Fact]
    loc_of_recep: dict[str, str]
    loc_of_obj: dict[str, str]
    agent_loc: str | None
    held: list[str]
    opened: set[str]
    openable: set[str]

    @classmethod
    def of(cls, facts: frozenset[Fact]) -> _Scene:
        return cls(
            facts=facts,
            loc_of_recep=_index(facts, "receptacleatlocation"),
            loc_of_obj=_index(facts, "objectatlocation"),
            agent_loc=next((f[2] for f in facts if f[0] == "atlocation"), None),
            held=holding(facts),
            opened={f[1] for f in facts if f[0] == "opened"},
            openable={f[1] for f in facts if f[0] == "openable"},
        )

    def away(self, recep: str) -> str | None:
        return f"you are not at {recep}" if self.loc_of_recep.get(recep) != self.agent_loc else None

    def closed(self, recep: str) -> bool:
        return recep in self.openable and recep not in self.opened


def _why_not_go_to(r: str, scene: _Scene) -> str:
    if r not in scene.loc_of_recep:
        return f"{r} is not a place you can go to"
    return f"you are already at {r}" if scene.loc_of_recep[r] == scene.agent_loc else "you cannot go there"


def _why_not_open_or_close(verb: str, r: str, scene: _Scene) -> str:
    if r not in scene.openable:
        return f"{r} cannot be opened or closed"
    return scene.away(r) or (f"{r} is already open" if verb == "open" else f"{r} is already closed")


def _why_not_take(o: str, r: str, scene: _Scene) -> str:
    if scene.held:
        return f"your hands are full: you are holding {scene.held[0]}"
    if _index(scene.facts, "inreceptacle").get(o) != r:
        return f"{o} is not in/on {r}"
    return scene.away(r) or (f"{r} is closed" if scene.closed(r) else f"{o} cannot be picked up")


def _why_not_put_or_apply(verb: str, o: str, r: str, scene: _Scene) -> str:
    """put, heat, cool, clean: each an object the agent holds, taken to a receptacle it is at."""
    if o not in scene.held:
        return f"you are not holding {o}"
    if reason := scene.away(r):
        return reason
    if verb == "put":
        return f"{r} is closed" if scene.closed(r) else f"{o} cannot go in/on {r}"
    return f"you cannot {verb} {o} with {r}"
