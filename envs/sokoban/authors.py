"""Sokoban's prompt as the paper's authors' code base wrote it (``prompt.style: authors``; ``envs.authors``).

The templates are verl-agent's text-mode ones, character for character (agent_system/environments/
prompts/sokoban.py:17-76 at OliverLeeXZ/SERL@5a2a85b), filled as its environment manager fills
them (agent_system/environments/env_manager.py:220-251). They describe their grid, so the room is
shown in it: each cell one of `` # ``, `` _ ``, `` O ``, `` √ ``, `` X ``, `` P ``, `` S `` followed by
a tab, one row per line (env_package/sokoban/sokoban/env.py:12-21, 124-126), translated from
serl's symbols. Past actions are shown as their action names, ``Up`` ... ``Right``, and ``Still``
for a reply that named no move (env_manager.py:158-164, 198). Their projection takes the first of
up, down, left, right, still found in the tagged action; none, or no tags, is ``still``, which
moves nothing (env_package/sokoban/projection.py:36-77); there is no CJK rule for Sokoban.
"""

from __future__ import annotations

from envs.authors import AuthorsPrompt, history_fields, reply_problem, tagged_action
from envs.sokoban.rooms import BOX, BOX_ON_GOAL, FLOOR, GOAL, PLAYER, PLAYER_ON_GOAL, WALL

_HEAD = (
    "\n"
    "You are an expert agent operating in the Sokoban environment.\n"
    "\n"
    "# Symbols and Their Meaning\n"
    "- Walls (`#`): These block movement. You can't move through or push anything into walls.\n"
    "- Floor (`_`): Open spaces where you can walk and move boxes.\n"
    "- Targets (`O`): The spots where boxes need to go.\n"
    "- Boxes (`X`): These are what you need to push onto the targets.\n"
    "- Player (`P`): That's you! You'll move around the grid to push boxes.\n"
    "- Box on Target (`\u221a`): A box successfully placed on a target.\n"
    "- Player on Target (`S`): You standing on a target.\n"
    "\n"
    "# Your Goal\n"
    "Your goal is to push all the boxes (`X`) onto the target spots (`O`). Once all boxes are on the targets, "
    "you win!\n"
    "\n"
    "# Rules\n"
    "You can only push boxes. You can't pull them, so plan ahead to avoid getting stuck.\n"
    "You can't walk through or push boxes into walls (`#`).\n"
    "To avoid traps, do not push boxes into corners or against walls where they can't be moved again.\n"
    "\n"
    "# Current Step\n"
)
_TAIL = (
    'Your admissible actions are ["up", "down", "left", "right"].\n'
    "\n"
    "Now it's your turn to make a move (choose ONE action only for the current step).\n"
    "You should first reason step-by-step about the current situation \u2014 observe the positions of boxes and "
    "targets, plan a path to push a box toward a target, and avoid traps like corners or walls. This reasoning "
    "process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step "
    "and present it within <action> </action> tags.\n"
)
TEMPLATE_NO_HIS = _HEAD + "Your current observation is:\n{current_observation}\n" + _TAIL  # prompts/sokoban.py:17-45
TEMPLATE = (  # prompts/sokoban.py:47-76
    _HEAD + "Prior to this step, you have already taken {step_count} step(s). Below are the most recent "
    "{history_length} observations and the corresponding actions you took: {action_history}\n"
    "You are now at step {current_step} and your current observation is:\n{current_observation}\n" + _TAIL
)
# serl's symbols -> their cells (env_package/sokoban/sokoban/env.py:12-21: wall, floor, target, box on
# target, box, player, player on target; a tab after each)
CELLS = {
    WALL: " # \t",
    FLOOR: " _ \t",
    GOAL: " O \t",
    BOX_ON_GOAL: " \u221a \t",
    BOX: " X \t",
    PLAYER: " P \t",
    PLAYER_ON_GOAL: " S \t",
}
MOVES = ("up", "down", "left", "right", "still")  # projection.py:36-42, searched in this order
STILL = "still"


def grid_text(observation: str) -> str:
    """serl's room (symbols separated by spaces, one row per line) in their ``tiny_rgb_array`` text."""
    return "\n".join("".join(CELLS[c] for c in row.split()) for row in observation.split("\n"))


def action_name(action: str) -> str:
    """How their memory records a move: Up, Down, Left, Right, or Still (env_manager.py:158-164)."""
    return action.capitalize() if action in MOVES else "Still"


def message(instruction: str, past: list[tuple[str, str]], observation: str, admissible: list[str], k: int) -> str:
    if not past or k <= 0:
        return TEMPLATE_NO_HIS.format(current_observation=grid_text(observation))
    return TEMPLATE.format(
        current_observation=grid_text(observation),
        **history_fields([(grid_text(obs), action_name(act)) for obs, act in past], k),
    )


def project(reply: str) -> tuple[str, str | None]:
    tagged = tagged_action(reply)
    action = next((m for m in MOVES if tagged is not None and m in tagged), None)
    problem = reply_problem(reply, cjk=False)
    if problem is None and action is None:
        problem = "invalid reply: no move (up, down, left, right, still) inside <action>...</action>"
    return action or STILL, problem


PROMPT = AuthorsPrompt(message=message, project=project)
