"""``prompt.style: authors``: the paper authors' prompt, reply rule and action spans, and GiGPO's
observation anchor (docs/PARITY.md).

The fixture of truth is the authors' template strings, copied verbatim into
tests/fixtures/authors_templates.txt from github.com/OliverLeeXZ/SERL at 5a2a85b
(agent_system/environments/prompts/{alfworld,webshop,sokoban}.py, file:lines on each header).
Each prompt test fills them by hand, as their environment manager does
(agent_system/environments/env_manager.py), renders the text through the Qwen2.5 chat template
fixture as one user message (agent_system/multi_turn_rollout/rollout_loop.py:208-219) and
compares token ids with serl's ``authors`` prompt.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
from rich.console import Console
from support import family_tokenizer, turn_sample

from envs.alfworld import authors as alfworld_authors
from envs.base import Feedback, Step
from envs.sokoban import authors as sokoban_authors
from envs.webshop import authors as webshop_authors
from serl_cli.algos.objectives import get_objective
from serl_cli.artifacts.records import make_annotation, make_episode, make_turn
from serl_cli.artifacts.schema import turn_samples
from serl_cli.errors import SerlError
from serl_cli.method.action_mask import action_span_mask
from serl_cli.rollout.engines import Generation, ModelPolicy, SamplingConfig
from serl_cli.rollout.prompts import PromptConfig, authors_action_spans, check_style
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.training.train_config import TrainConfig
from serl_cli.views import show

FIXTURE = Path(__file__).parent / "fixtures" / "authors_templates.txt"
AUTHORS = PromptConfig(style="authors", max_admissible=-1)


def templates() -> dict[str, str]:
    """NAME -> template, exactly as between the source's triple quotes."""
    text = FIXTURE.read_text(encoding="utf-8")
    parts = re.split(r"^=== (\w+) \S+\n", text, flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


T = templates()


def qwen_ids(tok, text: str) -> list[int]:
    """The authors' rendering: one user message, the chat template's own system prompt (rollout_loop.py:208-219)."""
    ids = tok.apply_chat_template([{"content": text, "role": "user"}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def serl_ids(tok, recipe, instruction: str, turns: list[tuple[str, str]], observation: str, admissible, cfg=AUTHORS):
    """serl's ``authors`` prompt for a turn after ``turns`` (observation, action) of an episode."""
    policy = ModelPolicy(SimpleNamespace(tokenizer=tok), SamplingConfig(), cfg)
    step = Step(observation, 0.0, False, Feedback(), list(admissible), "k", None)
    ctx = {
        "instruction": instruction,
        "turns": [make_turn(observation=o, action=a) for o, a in turns],
        "rules": "RULES",
        "authors_prompt": recipe,
    }
    return policy.prompts([step], [ctx])[0]


@pytest.fixture(scope="module")
def qwen():
    return family_tokenizer("qwen2.5")


def test_fixture_holds_the_six_templates():
    names = [f"{env}_TEMPLATE{suffix}" for env in ("ALFWORLD", "WEBSHOP", "SOKOBAN") for suffix in ("_NO_HIS", "")]
    assert sorted(T) == sorted(names)
    assert all(t.startswith("\n") and "tags. \n" in t for t in T.values())  # their leading newline, trailing space


# ------------------------------------------------------------------------------ ALFWorld
ALF_FIRST = (
    "-= Welcome to TextWorld, ALFRED! =-\n\nYou are in the middle of a room. Looking quickly around you, you see "
    "a countertop 1, and a sinkbasin 1.\n\nYour task is to: put a clean mug in coffeemachine."
)
ALF_TURNS = [
    (ALF_FIRST, "go to countertop 1"),
    ("You arrive at countertop 1. On the countertop 1, you see a mug 1.", "take mug 1 from countertop 1"),
    ("You pick up the mug 1 from the countertop 1.", "go to sinkbasin 1"),
]
ALF_NOW = "You arrive at sinkbasin 1. On the sinkbasin 1, you see nothing."
ALF_ADMISSIBLE = ["clean mug 1 with sinkbasin 1", "go to countertop 1", "help", "inventory", "look"]


def test_alfworld_authors_prompt_is_theirs_token_for_token(qwen):
    listed = "'clean mug 1 with sinkbasin 1'\n 'go to countertop 1'\n 'inventory'\n 'look'"  # help left out
    first = T["ALFWORLD_TEMPLATE_NO_HIS"].format(current_observation=ALF_FIRST, admissible_actions=listed)
    got = serl_ids(qwen, alfworld_authors.PROMPT, "put a clean mug in coffeemachine.", [], ALF_FIRST, ALF_ADMISSIBLE)
    assert got == qwen_ids(qwen, first)
    later = T["ALFWORLD_TEMPLATE"].format(
        task_description="put a clean mug in coffeemachine.",
        step_count=3,
        history_length=2,
        action_history=(
            "[Observation 2: 'You arrive at countertop 1. On the countertop 1, you see a mug 1.', "
            "Action 2: 'take mug 1 from countertop 1']\n"
            "[Observation 3: 'You pick up the mug 1 from the countertop 1.', Action 3: 'go to sinkbasin 1']"
        ),
        current_step=4,
        current_observation=ALF_NOW,
        admissible_actions=listed,
    )
    got = serl_ids(
        qwen, alfworld_authors.PROMPT, "put a clean mug in coffeemachine.", ALF_TURNS, ALF_NOW, ALF_ADMISSIBLE
    )
    assert got == qwen_ids(qwen, later)
    text = qwen.decode(got)  # no system message of serl's: Qwen's default one, then one user message
    assert text.count("<|im_start|>") == 3 and "You are Qwen, created by Alibaba Cloud." in text


# ------------------------------------------------------------------------------ WebShop
WEB_TASK = "i need a red mug, and price lower than 10.00 dollars"
WEB_START = f"WebShop [SEP] Instruction: [SEP] {WEB_TASK} [SEP] Search"
WEB_RESULTS = (
    f"Instruction: [SEP] {WEB_TASK} [SEP] Back to Search [SEP] Page 1 (Total results: 2) [SEP] Next > "
    "[SEP] B01 [SEP] Red Mug [SEP] $5.00 [SEP] B02 [SEP] Blue Mug [SEP] $4.00"
)
WEB_ITEM = (
    f"Instruction: [SEP] {WEB_TASK} [SEP] Back to Search [SEP] < Prev [SEP] Red Mug [SEP] Price: $5.00 "
    "[SEP] Rating: N.A. [SEP] Description [SEP] Features [SEP] Reviews [SEP] Buy Now"
)
WEB_ITEM_ADMISSIBLE = ["click[back to search]", "click[< prev]", "click[description]", "click[buy now]"]


def test_webshop_authors_prompt_is_theirs_token_for_token(qwen):
    first = T["WEBSHOP_TEMPLATE_NO_HIS"].format(
        task_description=WEB_TASK, current_observation="'Search'", available_actions="'search[<your query>]',"
    )
    got = serl_ids(qwen, webshop_authors.PROMPT, WEB_TASK, [], WEB_START, ["search[<query>]"])
    assert got == qwen_ids(qwen, first)
    later = T["WEBSHOP_TEMPLATE"].format(
        task_description=WEB_TASK,
        step_count=2,
        history_length=2,
        action_history=(
            "[Observation 1: ''Search'', Action 1: 'search[red mug]']\n"
            "[Observation 2: ''Back to Search' [SEP] 'Page 1 (Total results: 2)' [SEP] 'Next >' [SEP] 'B01' [SEP] "
            "'Red Mug' [SEP] '$5.00' [SEP] 'B02' [SEP] 'Blue Mug' [SEP] '$4.00'', Action 2: 'click[b01]']"
        ),
        current_step=3,
        current_observation=(
            "'Back to Search' [SEP] '< Prev' [SEP] 'Red Mug' [SEP] 'Price: $5.00' [SEP] 'Rating: N.A.' [SEP] "
            "'Description' [SEP] 'Features' [SEP] 'Reviews' [SEP] 'Buy Now'"
        ),
        available_actions="'click[back to search]',\n'click[< prev]',\n'click[description]',\n'click[buy now]',",
    )
    turns = [(WEB_START, "search[red mug]"), (WEB_RESULTS, "click[b01]")]
    got = serl_ids(qwen, webshop_authors.PROMPT, WEB_TASK, turns, WEB_ITEM, WEB_ITEM_ADMISSIBLE)
    assert got == qwen_ids(qwen, later)


def test_webshop_long_history_falls_back_to_the_plain_template():
    """env_manager.py:408-414: a prompt with history past 13,000 characters is sent without it."""
    long_page = f"Instruction: [SEP] {WEB_TASK} [SEP] Back to Search [SEP] " + "x" * 13_000
    text = webshop_authors.message(WEB_TASK, [(WEB_START, "search[mug]")], long_page, [], 2)
    assert text.startswith(T["WEBSHOP_TEMPLATE_NO_HIS"][:60]) and "Prior to this step" not in text


# ------------------------------------------------------------------------------ Sokoban
SOKO_START = "# # # # #\n# P B G #\n# # # # #"  # serl's room: you, a box, a goal
SOKO_NOW = "# # # # #\n# _ P * #\n# # # # #"


def test_sokoban_authors_prompt_is_theirs_token_for_token(qwen):
    grid = lambda rows: "\n".join("".join(f" {c} \t" for c in row) for row in rows)  # noqa: E731 -- their cells
    start = grid(["#####", "#PXO#", "#####"])
    now = grid(["#####", "#_P\u221a#", "#####"])
    first = T["SOKOBAN_TEMPLATE_NO_HIS"].format(current_observation=start)
    assert serl_ids(qwen, sokoban_authors.PROMPT, "", [], SOKO_START, ["up"]) == qwen_ids(qwen, first)
    later = T["SOKOBAN_TEMPLATE"].format(
        step_count=2,
        history_length=2,
        action_history=f"[Observation 1: '{start}', Action 1: 'Still']\n[Observation 2: '{start}', Action 2: 'Right']",
        current_step=3,
        current_observation=now,
    )
    turns = [(SOKO_START, "still"), (SOKO_START, "right")]
    assert serl_ids(qwen, sokoban_authors.PROMPT, "", turns, SOKO_NOW, ["up"]) == qwen_ids(qwen, later)


# ------------------------------------------------------------------------------ the reply rule
@pytest.mark.parametrize(
    "module, reply, action, invalid",
    [
        (alfworld_authors, "<think>go</think><action>Go To Desk 1</action>", "go to desk 1", False),
        (alfworld_authors, "<action>look</action>", "look", True),  # no <think>: executed, but invalid
        (alfworld_authors, "<think>a</think><action>look</action><action>inventory</action>", "look", False),
        (alfworld_authors, "<THINK>a</THINK><action>look</action>", "look", True),  # think tags are case-sensitive
        (alfworld_authors, "<think>\u6211</think><action>look</action>", "look", True),  # CJK
        (alfworld_authors, "I would like to look around the room now", "ke to look around the room now", True),
        (webshop_authors, "<think>x</think> <ACTION> click[Buy Now] </ACTION>", "click[buy now]", False),
        (webshop_authors, "just click[buy now] please", "lick[buy now] please", True),  # its last 20 characters
        (sokoban_authors, "<think>push</think><action>move Right</action>", "right", False),
        (sokoban_authors, "<think>t</think><action>stay still</action>", "still", False),
        (sokoban_authors, "<think>t</think><action>jump</action>", "still", True),
        (sokoban_authors, "<think>\u6211</think><action>up</action>", "up", False),  # no CJK rule for Sokoban
        (sokoban_authors, "up", "still", True),
    ],
)
def test_projection_is_theirs(module, reply, action, invalid):
    got, problem = module.PROMPT.project(reply)
    assert (got, problem is not None) == (action, invalid)


class ScriptedEngine:
    """Writes the given replies in turn: the policy's parse, the runner and the samples are what is tested."""

    def __init__(self, tokenizer, replies):
        self.tokenizer, self.replies = tokenizer, list(replies)

    def generate(self, prompts, sampling, seed, row_seeds=None):
        return [Generation(self.tokenizer.encode(self.replies.pop(0), add_special_tokens=False)) for _ in prompts]


def test_authors_style_flags_invalid_replies_not_refused_actions(qwen):
    """Their rule: a well-formed reply the shop refuses is valid (the penalty skips it); one without
    <think> is invalid although its action runs (projection.py:52-56, ray_trainer.py:198-222)."""
    world = build_world(EnvConfig(name="webshop", split="train", settings={"catalog": "synthetic"}))
    replies = [
        "<think>look</think><action>click[nothing here]</action>",  # well-formed, refused by the shop
        "<action>search[mug]</action>",  # no <think>: the search runs, the reply is invalid
        "<think>a</think> click[back to search]",  # no tags: its last 20 characters go to the shop
    ]
    policy = ModelPolicy(ScriptedEngine(qwen, replies), SamplingConfig(), AUTHORS)
    (rec,) = run_episodes(world, "train", [EpisodeSpec(task_id=0)], policy, max_turns=3)
    turns = rec.turns
    assert [t.invalid for t in turns] == [False, True, True]
    assert turns[0].feedback["error"] and "is not clickable" in turns[0].feedback["error"]
    assert "no <think>" in turns[1].feedback["error"] and turns[1].next_observation != turns[1].observation
    assert turns[2].action == "lick[back to search]" and "no <action>" in turns[2].feedback["error"]
    assert rec.invalid_actions == 2
    assert [s.invalid for s in turn_samples([rec])] == [False, True, True]
    serl_style = ModelPolicy(ScriptedEngine(qwen, replies), SamplingConfig(), PromptConfig())
    (plain,) = run_episodes(world, "train", [EpisodeSpec(task_id=0)], serl_style, max_turns=3)
    assert all("invalid" not in t.to_dict() for t in plain.turns)  # serl's records are as before


def test_authors_style_needs_an_environment_that_supplies_it():
    check_style(AUTHORS, SimpleNamespace(name="webshop", authors_prompt=webshop_authors.PROMPT))
    with pytest.raises(SerlError, match="the toy environment has no authors' prompt"):
        check_style(AUTHORS, SimpleNamespace(name="toy"))
    with pytest.raises(SerlError, match="unknown prompt.style 'theirs'"):
        check_style(PromptConfig(style="theirs"))


# ------------------------------------------------------------------------------ action spans
@pytest.mark.parametrize(
    "text, spans",
    [
        ("<think>a</think><action>click[x]</action>", ["click[x]"]),
        ("<action>up</action> then <ACTION>down</ACTION>", ["up", "down"]),  # every tag, any case
        ("<action kind='move'>left</action>", ["left"]),  # a tag with attributes
        ("[action>go to desk 1</action>]", ["go to desk 1"]),  # malformed opening tags
        ("think first <action>go to desk 1", ["go to desk 1"]),  # unclosed: to the end
        ("I'll search[red mug] then Click[B01]", ["search[red mug]", "Click[B01]"]),  # verbs anywhere
        ("<action></action>", ["</action>"]),  # as theirs: empty tags skipped, the unclosed rule takes the rest
        ("no action here", []),
    ],
)
def test_authors_action_spans_by_hand(text, spans):
    assert [text[a:b] for a, b in authors_action_spans(text)] == spans


def test_authors_mask_marks_every_tagged_action_and_keeps_reasoning_at_one(qwen):
    reply = "<think>the mug is red</think><action>click[b01]</action><action>click[buy now]</action>"
    ids = qwen.encode(reply, add_special_tokens=False)
    text_of = lambda mask: "".join(qwen.decode([i]) for i, m in zip(ids, mask, strict=True) if m)  # noqa: E731
    theirs, last = text_of(action_span_mask(qwen, ids, spans="authors")), text_of(action_span_mask(qwen, ids))
    assert "click[b01]" in theirs and "click[buy now]" in theirs and "mug" not in theirs  # reasoning keeps 1
    assert "click[b01]" not in last and "click[buy now]" in last  # serl's: the last tag only
    untagged = qwen.encode("I will click[buy now]", add_special_tokens=False)
    assert sum(action_span_mask(qwen, untagged, spans="authors")) > 0 and sum(action_span_mask(qwen, untagged)) == 0
    with pytest.raises(SerlError, match="unknown action_spans"):
        action_span_mask(qwen, ids, spans="first")


# ------------------------------------------------------------------------------ GiGPO's anchor key
def _gigpo_turn(episode, turn, state, observation, reward):
    reward_now = reward if turn == 1 else 0.0  # the episode's reward comes on its last (second) turn
    return turn_sample(episode, reward, turn=turn, state=state, turn_reward=reward_now, observation=observation)


def test_gigpo_observation_anchor_pools_nothing_happens():
    """Two rollouts: the winner's first step and the loser's both answered "Nothing happens." from
    different world states. By state they are two lone anchors (step advantage 0); by the authors'
    key, the raw text, one anchor of two (mean_norm: each return minus their mean)."""
    samples = [
        _gigpo_turn(0, 0, "s1", "Nothing happens.", 1.0),
        _gigpo_turn(0, 1, "s2", "You arrive at desk 1.", 1.0),
        _gigpo_turn(1, 0, "s3", "Nothing happens.", 0.0),
        _gigpo_turn(1, 1, "s4", "You arrive at bed 1.", 0.0),
    ]
    by_state = get_objective("gigpo").prepare(samples, None, TrainConfig(algo="gigpo", gigpo_mode="mean_norm"))
    cfg = TrainConfig(algo="gigpo", gigpo_mode="mean_norm", gigpo_anchor="observation")
    by_text = get_objective("gigpo").prepare(samples, None, cfg)
    assert (by_state.stats["anchor_states"], by_text.stats["anchor_states"]) == (4, 3)
    # returns: winner 0.95 * 1 = 0.95 at turn 0; loser 0 -> pooled mean 0.475, step advantages +-0.475
    step = by_text.advantages - by_state.advantages
    assert step.tolist() == pytest.approx([0.475, 0.0, -0.475, 0.0])
    with pytest.raises(SerlError, match="unknown train.gigpo_anchor"):
        get_objective("gigpo").prepare(samples, None, TrainConfig(algo="gigpo", gigpo_anchor="facts"))


# ------------------------------------------------------------------------------ serl show
def test_show_renders_reasoning_and_action_with_their_weights(qwen):
    reply = "<think>red</think><action>click[b01]</action>"
    ids = qwen.encode(reply, add_special_tokens=False)
    mask = action_span_mask(qwen, ids)
    weights = [1.15 if m else 1.0 for m in mask]
    turn = make_turn(
        observation="o",
        action_text=reply,
        action="click[b01]",
        action_ids=ids,
        feedback={"error": None, "diff": "page item"},
        invalid=False,
    )
    rec = make_annotation(selected=True, sources=["obs"], hindsight="h", advantage=1.0)
    rec.log_ratio_mean, rec.weights, rec.action_mask = 0.1, weights, mask
    console = Console(record=True, width=200)
    console.print(show.turn_view(0, turn, rec, False, qwen, 0.2))
    text = console.export_text()
    assert (
        "reasoning" in text and "<think>red</think><action>" in text and f"({mask.count(0)} tokens, weight 1)" in text
    )
    action_row = next(line for line in text.splitlines() if "action w" in line)
    assert action_row.count("·1.150") == sum(mask) and "invalid" in text


def test_turn_samples_carry_the_observation():
    turn = make_turn(prompt_ids=[1], action_ids=[2], behaviour_logprobs=[-1.0], state_key="k")
    episode = make_episode([replace(turn, observation="Nothing happens.", feedback={"error": None})])
    (s,) = turn_samples([episode])
    assert s.observation == "Nothing happens." and not s.invalid
