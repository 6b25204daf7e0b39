"""Prompts (METHOD.md section 2) and the action parser.

A turn's prompt is a chat: a system message with the environment's rules and the action
format, then one user message with the task instruction, the last K turns (observation
and the action taken), the current observation and the admissible actions. It is rendered
with the tokenizer's own chat template, and the rendered token ids are what gets stored.

The policy may think before it acts; the action is the text inside the last
``<action>...</action>``, or, with no tags, the whole reply (a bare action).

``prompt.style: authors`` prompts as the paper's authors do instead (``envs.authors``): one user
message, no system message (the chat template's default system prompt applies, as Qwen's does),
from the environment's own template with its history block, step count, admissible actions and
the instruction to reason inside ``<think> </think>`` and act inside ``<action> </action>``; the
reply is parsed and judged valid by their rule (the environment's ``authors_prompt.project``).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, get_args

from envs.base import ActionFormat, ActionFormatted, AuthorsPrompted
from serl_cli.config import at_least, setting
from serl_cli.errors import SerlError

ACTION_TAG_RE = re.compile(r"<action>(.*?)</action>", re.DOTALL)
BARE_ACTION_RE = re.compile(r"[a-z][a-z ]*\[.*\]", re.DOTALL)  # WebShop's verb[argument]


PromptStyle = Literal["serl", "authors"]
PROMPT_STYLES = get_args(PromptStyle)
DEFAULT_ACTION_FORMAT = ActionFormat(example="click[buy now]", bare=BARE_ACTION_RE)  # WebShop's
ACTION_FORMAT = DEFAULT_ACTION_FORMAT.instruction()


def action_format_of(world) -> ActionFormat:
    return world.action_format if isinstance(world, ActionFormatted) else DEFAULT_ACTION_FORMAT


@dataclass
class PromptConfig:
    """What a turn's prompt shows, and how a demonstration's reply is written.

    ``max_admissible: 0``, ``system: false`` and ``bare_replies: true`` are for models
    trained from scratch on CPU (the Sokoban demo's micro model). Such a model learns nothing
    from text that never changes, and pays for every token of it at rollout, in the update
    and in the teacher. And it learns to act much more slowly when each demonstrated reply
    wraps its one deciding token in five predictable ones (``<action>``, the tags, the end of
    turn): on Sokoban its loss sat at chance for over 250 SFT steps with tagged replies,
    and left it within 60 with bare ones. A pretrained model needs the system message to know
    the game, and reads either reply.
    """

    style: PromptStyle = setting(
        "serl",
        "serl: serl's prompt (a system message with the rules, the reply <action>...</action>) | authors: the "
        "paper authors' (envs.authors: one user message, <think> then <action>, their invalid-reply rule)",
    )
    history_turns: int = setting(
        2, "K: how many past turns to show; -1: all", limit=at_least(-1, "-1 (all), 0 or more", whole=True)
    )
    history_obs_chars: int = setting(
        400,
        "serl style: each past observation is cut to this many characters (authors: whole)",
        limit=at_least(0, "0 or more", whole=True),
    )
    max_admissible: int = setting(
        40,
        "list at most this many admissible actions; 0: no list (authors: []); -1: all",
        limit=at_least(-1, "-1 (all), 0 (no list) or more", whole=True),
    )
    system: bool = setting(
        True, "serl style: the system message (the environment's rules, the action format); false: none"
    )
    bare_replies: bool = setting(False, "demonstrations reply with the bare action, not <action>...</action>")
    instruction: str = setting(
        "",
        "serl style: a line added at the end of the user message, e.g. the reply format a small chat model "
        "needs to hear last (experiments/smollm2/); empty: none",
    )
    chat_template_kwargs: dict = setting(
        factory=dict,
        doc="keyword arguments for the tokenizer's chat template, on every prompt the student and the teacher "
        "see, e.g. {enable_thinking: false} for Qwen3 (docs/MODELS.md, Model families)",
    )


PROMPT_FILE = "serl_prompt.json"  # beside a checkpoint: the prompt settings it was trained with


def prompt_file_text(cfg: PromptConfig) -> str:
    return json.dumps(asdict(cfg), indent=2) + "\n"


def trained_prompt(model_name: str | None) -> PromptConfig | None:
    """The prompt settings a serl checkpoint was trained with (None for any other model)."""
    path = Path(model_name) / PROMPT_FILE if model_name else None
    if path is None or not path.is_file():
        return None
    try:
        return PromptConfig(**json.loads(path.read_text(encoding="utf-8")))
    except (json.JSONDecodeError, TypeError):
        return None  # an unreadable record: fall back to the defaults rather than guess


def build_messages(
    rules: str,
    instruction: str,
    history: list[dict],
    observation: str,
    admissible: list[str],
    cfg: PromptConfig,
    action_format: ActionFormat = DEFAULT_ACTION_FORMAT,
) -> list[dict]:
    """``history`` holds the episode's past turns (dicts with ``observation`` and ``action``)."""
    k = len(history) if cfg.history_turns < 0 else cfg.history_turns
    shown = history[-k:] if k > 0 else []
    lines = [f"Task: {instruction}"]
    if shown:
        first = len(history) - len(shown)
        lines.append(f"Your last {len(shown)} turn(s):")
        for i, t in enumerate(shown, start=first + 1):
            obs = t["observation"]
            if len(obs) > cfg.history_obs_chars:
                obs = obs[: cfg.history_obs_chars] + " ..."
            lines.append(f"[turn {i}] observation: {obs}\n[turn {i}] action: {t['action']}")
    lines.append(f"Turn {len(history) + 1}. Current observation: {observation}")
    if admissible and cfg.max_admissible != 0:
        listed = admissible_shown(admissible, cfg)
        more = f" (and {len(admissible) - len(listed)} more)" if len(admissible) > len(listed) else ""
        lines.append("Admissible actions: " + ", ".join(listed) + more)
    if cfg.instruction:  # last: a small chat model follows what it read last (docs/MODELS.md, SmolLM2)
        lines.append(cfg.instruction)
    user = {"role": "user", "content": "\n".join(lines)}
    if not cfg.system:
        return [user]
    return [{"role": "system", "content": f"{rules}\n{action_format.instruction()}"}, user]


def admissible_shown(admissible: list[str], cfg: PromptConfig) -> list[str]:
    """The admissible actions a prompt lists: the first ``max_admissible`` (-1: all of them)."""
    return list(admissible) if cfg.max_admissible < 0 else admissible[: cfg.max_admissible]


def check_style(cfg: PromptConfig, world=None) -> None:
    """A known ``prompt.style``, and with ``world`` one it supplies a prompt for."""
    if cfg.style not in PROMPT_STYLES:
        raise SerlError(f"unknown prompt.style {cfg.style!r}: choose one of {', '.join(PROMPT_STYLES)}")
    if cfg.style == "authors" and world is not None and not isinstance(world, AuthorsPrompted):
        raise SerlError(
            f"prompt.style authors: the {getattr(world, 'name', 'given')} environment has no authors' prompt "
            "(ALFWorld, WebShop and Sokoban have one): use prompt.style serl"
        )


def authors_messages(recipe, instruction: str, history: list[dict], observation: str, admissible: list[str], cfg):
    """The authors' prompt (``prompt.style: authors``): one user message from the environment's
    ``authors_prompt`` (``envs.authors.AuthorsPrompt``), the last K turns (-1: all) in its history
    block and the admissible actions ``max_admissible`` allows; no system message."""
    if recipe is None:
        raise SerlError("prompt.style authors: this environment has no authors' prompt: use prompt.style serl")
    k = len(history) if cfg.history_turns < 0 else cfg.history_turns
    past = [(t["observation"], t["action"]) for t in history]
    return [
        {
            "role": "user",
            "content": recipe.message(instruction, past, observation, admissible_shown(admissible, cfg), k),
        }
    ]


# apply_chat_template's arguments serl sets itself: not chat template keyword arguments
RESERVED_TEMPLATE_KWARGS = ("conversation", "add_generation_prompt", "tokenize")


def check_chat_template_kwargs(kwargs: dict) -> None:
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise SerlError(f"prompt.chat_template_kwargs.{key} is set by serl itself: remove it")


def render_prompt_ids(tokenizer, messages: list[dict], chat_template_kwargs: dict | None = None) -> list[int]:
    """``messages`` rendered with the tokenizer's chat template and the assistant header;
    ``chat_template_kwargs`` (``PromptConfig.chat_template_kwargs``) reach the template."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, **(chat_template_kwargs or {})
    )
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in some transformers versions
        ids = ids["input_ids"]
    return list(ids)


def format_action(action: str) -> str:
    """How an action is written as a reply (expert demonstrations for SFT use this too)."""
    return f"<action>{action}</action>"


def format_reply(action: str, bare: bool = False) -> str:
    """A demonstration's reply: the action tagged (:func:`format_action`), or bare."""
    return action if bare else format_action(action)


def reply_ids(tokenizer, action: str, bare: bool = False) -> list[int]:
    """:func:`format_reply` tokenized, with the end-of-turn token: an SFT target."""
    return tokenizer.encode(format_reply(action, bare), add_special_tokens=False) + [end_of_turn_id(tokenizer)]


_REPLY_PROBE = "Probe reply"
# Facts probed from a tokenizer's chat template, rendered once per tokenizer: keyed by the tokenizer
# object's id and the question, holding the tokenizer so that the id stays its own.
_TOKENIZER_FACTS: dict[tuple, tuple] = {}


def tokenizer_fact(tokenizer, key, compute):
    """``compute()``, cached per tokenizer object and ``key`` (a hashable naming the question)."""
    hit = _TOKENIZER_FACTS.get((id(tokenizer), key))
    if hit is None or hit[0] is not tokenizer:
        hit = _TOKENIZER_FACTS[(id(tokenizer), key)] = (tokenizer, compute())
    return hit[1]


def end_of_turn_id(tokenizer) -> int:
    """The token that closes an assistant turn: the special token the chat template writes right
    after an assistant message (ChatML ``<|im_end|>``, Llama 3 ``<|eot_id|>``, Gemma
    ``<end_of_turn>``, Mistral ``</s>``), else the eos token. It is what a reply ends with (the
    engines stop there, an SFT target ends with it); Gemma's tokenizer does not name its end of
    turn as the eos token, so eos alone would let replies run on to the token budget."""
    return tokenizer_fact(tokenizer, "end_of_turn", lambda: _probe_end_of_turn(tokenizer))


def _probe_end_of_turn(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if not getattr(tokenizer, "chat_template", None):
        return eos
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Probe message"}, {"role": "assistant", "content": _REPLY_PROBE}],
            tokenize=False,
        )
    except Exception:  # a template that cannot render this conversation: keep eos
        return eos
    at = text.rfind(_REPLY_PROBE)
    if at < 0:
        return eos
    after = tokenizer.encode(text[at + len(_REPLY_PROBE) :], add_special_tokens=False)
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return after[0] if after and after[0] in special else eos


def stop_token_ids(tokenizer) -> list[int]:
    """Where generation stops: the end of turn (:func:`end_of_turn_id`), the eos token (a model
    may also end with it) and the pad token."""
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return sorted({t for t in (end_of_turn_id(tokenizer), eos, pad) if t is not None})


def parse_action(text: str, action_format: ActionFormat = DEFAULT_ACTION_FORMAT) -> tuple[str, str | None]:
    """(action, error): the action inside the last <action> tag, or a bare action.

    A reply with neither gives the reply itself as the action (the environment will
    reject it) and an error naming what was wrong, which becomes ``error`` feedback.
    """
    tagged = ACTION_TAG_RE.findall(text)
    if tagged:
        return tagged[-1].strip(), None
    stripped = text.strip()
    if "<action>" in stripped:
        return stripped, "malformed action: <action> is not closed by </action>"
    if action_format.bare.fullmatch(stripped):
        return stripped, None
    shown = stripped if len(stripped) <= 60 else stripped[:57] + "..."
    return stripped, f"malformed action {shown!r}: expected <action>{action_format.example}</action> or a bare action"


def action_span(text: str, action_format: ActionFormat = DEFAULT_ACTION_FORMAT) -> tuple[int, int] | None:
    """Character span of the parsed action inside the reply: the tokens SERL reweights.

    Reasoning before ``<action>`` lies outside the span and keeps weight 1 (METHOD.md 5).
    """
    matches = list(ACTION_TAG_RE.finditer(text))
    if matches:
        start, end = matches[-1].span(1)
        inner = text[start:end]  # the span covers what parse_action returns: stripped
        return start + len(inner) - len(inner.lstrip()), end - len(inner) + len(inner.rstrip())
    stripped = text.strip()
    if action_format.bare.fullmatch(stripped):
        start = text.index(stripped)
        return start, start + len(stripped)
    return None


# The authors' action spans (recipe/serl/serl_ray_trainer.py:23-29, 69-96 at OliverLeeXZ/SERL@5a2a85b):
# every span inside a tag of these three forms, any case, malformed ones included; else from an unclosed
# <action ...> to the end; else every WebShop search[...] / click[...] anywhere in the reply.
AUTHORS_TAGGED_RES = (
    re.compile(r"<action\b[^>]*>(.*?)</action>", re.IGNORECASE | re.DOTALL),
    re.compile(r"\[action>(.*?)</action>\]?", re.IGNORECASE | re.DOTALL),
    re.compile(r"action>(.*?)</action>", re.IGNORECASE | re.DOTALL),
)
AUTHORS_UNCLOSED_RE = re.compile(r"<action\b[^>]*>(.*)$", re.IGNORECASE | re.DOTALL)
AUTHORS_VERB_RE = re.compile(r"(?:search|click)\[[^\]\n]*\]", re.IGNORECASE)


def authors_action_spans(text: str) -> list[tuple[int, int]]:
    """Character spans the authors' ``serl_action_mask`` marks in a reply, sorted, touching or
    overlapping ones merged (serl_ray_trainer.py:69-96): ``annotate.action_spans: authors``."""
    spans = [m.span(1) for pattern in AUTHORS_TAGGED_RES for m in pattern.finditer(text) if m.end(1) > m.start(1)]
    if not spans:
        m = AUTHORS_UNCLOSED_RE.search(text)
        spans = [m.span(1)] if m is not None and m.end(1) > m.start(1) else []
    if not spans:
        spans = [m.span() for m in AUTHORS_VERB_RE.finditer(text)]
    merged: list[tuple[int, int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
