"""The reference action off the cached plan: alfworld's hand-coded expert.

alfworld 0.4.2's hand-coded TextWorld expert (``HandCodedTWAgent``) was written for the
2.1.2 games, where the put command reads ``move X to Y``; on these 2.1.1 games
(``put X in/on Y``) it never sees a put it can make. Rather than rewriting each game to
2.1.2 and running a second engine beside the first, it is shown a 2.1.2 view of the
2.1.1 state -- the admissible commands with put written the 2.1.2 way -- and its answer
is written back the 2.1.1 way. Everything else it reads (the observation text, the facts,
the task parameters in ``traj_data.json``) is the same in both versions. Its history
tracking looks for "put" in the last command, so it is told the agent's commands as the
agent wrote them.

It is a heuristic: it explores receptacles it has not checked, so it is not guaranteed to
win from every state (docs/ALFWORLD.md has the figures). Its random choices draw from a
generator seeded per game and turn, so the same history gives the same reference.
"""

from __future__ import annotations

import random
import re

_PUT_211 = re.compile(r"put (.+?) in/on (.+)")
_MOVE_212 = re.compile(r"move (.+?) to (.+)")


def to_212(command: str) -> str:
    m = _PUT_211.fullmatch(command)
    return f"move {m.group(1)} to {m.group(2)}" if m else command


def to_211(command: str) -> str:
    m = _MOVE_212.fullmatch(command)
    return f"put {m.group(1)} in/on {m.group(2)}" if m else command


class HandCodedReference:
    """Follows one episode and proposes the next command from its current state.

    Call :meth:`start` with the reset state, then :meth:`after` once per step with the
    agent's command and the new state; both return the expert's next command (or None
    where it has none, gave up or proposes something inadmissible)."""

    def __init__(self, game_file: str, seed: int = 0, max_steps: int = 200):
        from alfworld.agents.expert import HandCodedTWAgent

        self.agent = HandCodedTWAgent(max_steps=max_steps)
        self.agent.reset(game_file)  # reads the task parameters from traj_data.json beside it
        self.seed, self.turn = seed, 0
        self.alive = True

    def start(self, state) -> str | None:
        self.agent.observe(state["feedback"])  # the intro lists the receptacles
        return "look" if "look" in state["admissible_commands"] else None  # its fixed first move

    def after(self, command: str, state) -> str | None:
        self.turn += 1
        if not self.alive or state["won"]:
            return None
        view = {
            "feedback": state["feedback"],
            "facts": state["facts"],
            "admissible_commands": [to_212(c) for c in state["admissible_commands"]],
        }
        saved = random.getstate()
        random.seed(self.seed * 100_003 + self.turn)
        try:
            proposal = self.agent.act(view, 0, False, command)
        except Exception:  # HandCodedAgentTimeout/Failed, or its heuristics hit a state they do not cover
            self.alive = False
            return None
        finally:
            random.setstate(saved)
        proposal = to_211(str(proposal))
        return proposal if proposal in state["admissible_commands"] else None
