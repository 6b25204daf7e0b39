"""WebShop's prompt as the paper's authors wrote it (``prompt.style: authors``; ``envs.authors``).

The templates are verl-agent's, character for character (agent_system/environments/prompts/
webshop.py:17-44 at OliverLeeXZ/SERL@5a2a85b; "e‑commerce" with a non-breaking hyphen, U+2011),
filled as its environment manager fills them (agent_system/environments/env_manager.py:297-418):

* the task is the first page's third ``[SEP]`` part, the instruction (env_manager.py:338-344);
* a page is shown from after the instruction on, each part quoted: ``'Back to Search' [SEP]
  'Page 1 (Total results: 50)' [SEP] ...``; a page without the instruction (the final one) as
  it is (env_manager.py:346-359). Past observations in the history are shown the same way;
* the admissible actions are ``search[<your query>]`` where the page has a search bar, then
  ``click[...]`` for each clickable, each quoted and followed by a comma, one per line
  (env_manager.py:361-374, 389-390). Upstream also lists ``click[search]`` on the start page;
  serl's environment refuses that click (envs/webshop/env.py) and does not list it;
* a prompt with history longer than 13,000 characters falls back to the template without it
  (env_manager.py:408-414).
"""

from __future__ import annotations

from envs.authors import AuthorsPrompt, history_fields, project_text_action
from envs.webshop.pages import SEP

_TAIL = (
    "Your admissible actions of the current situation are: \n"
    "[\n"
    "{available_actions}\n"
    "].\n"
    "\n"
    "Now it's your turn to take one action for the current step.\n"
    "You should first reason step-by-step about the current situation, then think carefully which admissible "
    "action best advances the shopping goal. This reasoning process MUST be enclosed within <think> </think> tags. \n"
    "Once you've finished your reasoning, you should choose an admissible action for current step "
    "and present it within <action> </action> tags.\n"
)
TEMPLATE_NO_HIS = (  # prompts/webshop.py:17-29
    "\n"
    "You are an expert autonomous agent operating in the WebShop e\u2011commerce environment. \n"
    "Your task is to: {task_description}.\n"
    "Your current observation is: {current_observation}.\n" + _TAIL
)
TEMPLATE = (  # prompts/webshop.py:31-44
    "\n"
    "You are an expert autonomous agent operating in the WebShop e\u2011commerce environment.\n"
    "Your task is to: {task_description}.\n"
    "Prior to this step, you have already taken {step_count} step(s). Below are the most recent {history_length} "
    "observations and the corresponding actions you took: {action_history}\n"
    "You are now at step {current_step} and your current observation is: {current_observation}.\n" + _TAIL
)
TAIL_CHARS = 20  # an untagged reply hands its last 20 characters to the shop (webshop/projection.py:41)
MAX_CHARS = 13_000  # env_manager.py:408
SEARCH = "search[<query>]"  # serl's listing of the search bar; theirs reads search[<your query>]


def task_of(first_page: str, instruction: str) -> str:
    """The instruction as the first page shows it (its third part after ``WebShop``, ``Instruction:``)."""
    parts = first_page.split(SEP)
    return parts[2] if len(parts) > 2 and parts[1] == "Instruction:" else instruction


def page_text(page: str, task: str) -> str:
    """``page`` from after the instruction on, each part quoted; as it is without the instruction."""
    parts = page.split(SEP)
    if task not in parts:
        return page
    return SEP.join(f"'{p}'" for p in parts[parts.index(task) + 1 :])


def listed_actions(admissible: list[str]) -> str:
    actions = ["search[<your query>]" if a == SEARCH else a for a in admissible]
    return "\n".join(f"'{a}'," for a in actions)


def message(instruction: str, past: list[tuple[str, str]], observation: str, admissible: list[str], k: int) -> str:
    task = task_of(past[0][0] if past else observation, instruction)
    current, actions = page_text(observation, task), listed_actions(admissible)
    plain = TEMPLATE_NO_HIS.format(task_description=task, current_observation=current, available_actions=actions)
    if not past or k <= 0:
        return plain
    text = TEMPLATE.format(
        task_description=task,
        current_observation=current,
        available_actions=actions,
        **history_fields([(page_text(obs, task), act) for obs, act in past], k),
    )
    return plain if len(text) > MAX_CHARS else text


def project(reply: str) -> tuple[str, str | None]:
    return project_text_action(reply, TAIL_CHARS)


PROMPT = AuthorsPrompt(message=message, project=project)
