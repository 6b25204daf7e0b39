"""ALFWorld's prompt as the paper's authors wrote it (``prompt.style: authors``; ``envs.authors``).

The templates are verl-agent's, character for character (agent_system/environments/prompts/
alfworld.py:17-36 at OliverLeeXZ/SERL@5a2a85b), filled as its environment manager fills them
(agent_system/environments/env_manager.py:92-124): the first turn (or K = 0) without history;
later turns with the task, the step count, the last K turns and the current observation. The
admissible commands are every one but ``help``, each quoted, one per line after a space
(env_manager.py:104-105). The task is the first observation's text after "Your task is to: "
(env_manager.py:82-89), as serl's own ``instruction`` is.
"""

from __future__ import annotations

from envs.authors import AuthorsPrompt, history_fields, project_text_action

_REASON = (
    "Now it's your turn to take an action.\n"
    "You should first reason step-by-step about the current situation. "
    "This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step "
    "and present it within <action> </action> tags.\n"
)
TEMPLATE_NO_HIS = (  # prompts/alfworld.py:17-25
    "\n"
    "You are an expert agent operating in the ALFRED Embodied Environment.\n"
    "Your current observation is: {current_observation}\n"
    "Your admissible actions of the current situation are: [{admissible_actions}].\n"
    "\n" + _REASON
)
TEMPLATE = (  # prompts/alfworld.py:27-36
    "\n"
    "You are an expert agent operating in the ALFRED Embodied Environment. Your task is to: {task_description}\n"
    "Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} "
    "observations and the corresponding actions you took: {action_history}\n"
    "You are now at step {current_step} and your current observation is: {current_observation}\n"
    "Your admissible actions of the current situation are: [{admissible_actions}].\n"
    "\n" + _REASON
)
TAIL_CHARS = 30  # an untagged reply hands its last 30 characters to the game (alfworld/projection.py:40)


def message(instruction: str, past: list[tuple[str, str]], observation: str, admissible: list[str], k: int) -> str:
    listed = "\n ".join(f"'{a}'" for a in admissible if a != "help")
    if not past or k <= 0:
        return TEMPLATE_NO_HIS.format(current_observation=observation, admissible_actions=listed)
    return TEMPLATE.format(
        task_description=instruction,
        current_observation=observation,
        admissible_actions=listed,
        **history_fields(past, k),
    )


def project(reply: str) -> tuple[str, str | None]:
    return project_text_action(reply, TAIL_CHARS)


PROMPT = AuthorsPrompt(message=message, project=project)
