"""Prompts and the action parser (serl_cli.rollout.prompts): what the policy reads and how its reply
becomes an action. Fast: no model; one small tokenizer for the rendering test."""

from __future__ import annotations

import pytest

from serl_cli.models.tiny import EOS_TOKEN
from serl_cli.rollout.prompts import (
    ACTION_FORMAT,
    PromptConfig,
    action_span,
    build_messages,
    format_action,
    parse_action,
    render_prompt_ids,
)

# ---------------------------------------------------------------- parse_action / action_span


@pytest.mark.parametrize(
    "text,action",
    [
        ("search[red shoes]", "search[red shoes]"),  # bare
        ("click[buy now]", "click[buy now]"),
        ("<action>click[buy now]</action>", "click[buy now]"),  # tagged
        ("<think>the mug is 12 oz and blue, under budget</think><action>click[x]</action>", "click[x]"),
        ("I should buy it.\n<action>click[buy now]</action>", "click[buy now]"),  # free reasoning, no think tag
        ("<action>search[a]</action> no, better: <action>click[b]</action>", "click[b]"),  # last tag wins
        ("<think>maybe <action>click[a]</action>?</think><action>click[b]</action>", "click[b]"),
        ("<action>search[a]</action><action>search[b]</action><action>search[c]</action>", "search[c]"),
        ("  search[red shoes]  \n", "search[red shoes]"),  # whitespace around a bare action
        ("\n<action>  click[buy now]\n</action>\n", "click[buy now]"),  # whitespace inside the tag
        ("<action>search[red\nshoes]</action>", "search[red\nshoes]"),  # newlines inside are kept
        ("search[long clip-in hair extension, 18 inch]", "search[long clip-in hair extension, 18 inch]"),
        ("click[< prev]", "click[< prev]"),
        (format_action("click[b0xq33]"), "click[b0xq33]"),  # what SFT demonstrations write
    ],
)
def test_parse_action_accepts(text, action):
    assert parse_action(text) == (action, None)


def test_parse_action_unclosed_tag_is_an_error():
    action, error = parse_action("<think>ok</think><action>click[buy now]")
    assert error is not None and "</action>" in error
    assert action == "<think>ok</think><action>click[buy now]"  # the reply itself: the env rejects it
    # only an unclosed *last* tag after a closed one is not an error: the closed one is used
    assert parse_action("<action>click[a]</action><action>click[b]") == ("click[a]", None)


@pytest.mark.parametrize(
    "text",
    [
        "",
        "   \n",
        "I would buy the blue one",
        "I think search[red shoes]",  # a bare action must be the whole reply
        "search[red shoes] then click[buy now]!",
        "search red shoes",
        "[red shoes]",
        "<act>click[x]</act>",
        "\ufffd\ufffd ru",  # what an untrained model writes
    ],
)
def test_parse_action_rejects_garbage(text):
    action, error = parse_action(text)
    assert error is not None and "malformed action" in error and "<action>" in error
    assert action == text.strip()
    assert action_span(text) is None


def test_parse_action_error_shows_a_short_reply():
    text = "blah " * 40
    _, error = parse_action(text)
    assert "blah blah" in error and len(error) < 140 and "...'" in error


@pytest.mark.parametrize(
    "text,action",
    [
        ("search[red shoes]", "search[red shoes]"),
        ("  search[red shoes]\n", "search[red shoes]"),
        ("<action>click[buy now]</action>", "click[buy now]"),
        ("<think>click[a] looks wrong</think><action>click[x]</action>", "click[x]"),
        ("<action>click[a]</action> or <action>click[a]</action>", "click[a]"),  # the last, not the first
        ("click[a] <action>click[b]</action>", "click[b]"),
    ],
)
def test_action_span_covers_the_parsed_action_only(text, action):
    assert parse_action(text) == (action, None)
    start, end = action_span(text)
    assert text[start:end] == action
    if "<action>" in text:
        assert text[:start].endswith("<action>") and text[end:].startswith("</action>")
        assert start == text.rindex("<action>") + len("<action>")  # reasoning and earlier tags lie outside


def test_action_span_of_reasoning_reply():
    text = "<think>the blue one matches</think><action>click[b01]</action>"
    start, end = action_span(text)
    assert (start, end) == (len("<think>the blue one matches</think><action>"), len(text) - len("</action>"))
    assert "think" not in text[start:end]


def test_action_span_none_for_unclosed_tag():
    assert action_span("<action>click[x]") is None


# ---------------------------------------------------------------- build_messages

RULES = "You are shopping on a test store.\nAct with one action per turn."


def _history(n: int, obs_len: int = 20) -> list[dict]:
    # distinct, non-overlapping markers per turn so "exactly these turns" is checkable
    return [
        {"observation": f"<obs{i:02d}>" + "x" * (obs_len - 7), "action": f"click[act{i:02d}]"} for i in range(1, n + 1)
    ]


def _user(history, cfg=None, observation="PAGE NOW", admissible=("click[buy now]",), instruction="buy a mug"):
    # a fresh default config per call: PromptConfig is mutable, a shared default instance could leak between tests
    messages = build_messages(RULES, instruction, history, observation, list(admissible), cfg or PromptConfig())
    assert [m["role"] for m in messages] == ["system", "user"]
    return messages[1]["content"]


def _turns_shown(user: str) -> list[int]:
    return [i for i in range(1, 20) if f"<obs{i:02d}>" in user or f"click[act{i:02d}]" in user]


def test_system_message_holds_rules_and_action_format():
    messages = build_messages(RULES, "buy a mug", _history(3), "PAGE NOW", ["click[buy now]"], PromptConfig())
    assert messages[0] == {"role": "system", "content": f"{RULES}\n{ACTION_FORMAT}"}
    assert RULES not in messages[1]["content"] and ACTION_FORMAT not in messages[1]["content"]


def test_user_message_layout():
    user = _user(_history(3), instruction="i need a blue mug under 20 dollars")
    lines = user.split("\n")
    assert lines[0] == "Task: i need a blue mug under 20 dollars"
    assert lines[1] == "Your last 2 turn(s):"
    assert lines[2].startswith("[turn 2] observation: <obs02>") and lines[3] == "[turn 2] action: click[act02]"
    assert lines[4].startswith("[turn 3] observation: <obs03>") and lines[5] == "[turn 3] action: click[act03]"
    assert lines[6] == "Turn 4. Current observation: PAGE NOW"
    assert lines[7] == "Admissible actions: click[buy now]"
    assert len(lines) == 8


@pytest.mark.parametrize(
    "k,n,shown",
    [
        (2, 5, [4, 5]),  # the default: the last two, numbered by their place in the episode
        (2, 1, [1]),
        (2, 0, []),
        (0, 5, []),
        (1, 5, [5]),
        (-1, 5, [1, 2, 3, 4, 5]),  # all
        (-1, 0, []),
        (7, 5, [1, 2, 3, 4, 5]),  # more than there are
    ],
)
def test_history_window(k, n, shown):
    cfg = PromptConfig(history_turns=k)
    user = _user(_history(n), cfg)
    assert _turns_shown(user) == shown
    for i in shown:
        assert f"[turn {i}] observation: <obs{i:02d}>" in user and f"[turn {i}] action: click[act{i:02d}]" in user
    assert ("Your last" in user) == bool(shown)
    if shown:
        assert f"Your last {len(shown)} turn(s):" in user
    assert f"Turn {n + 1}. Current observation: PAGE NOW" in user


def test_default_history_is_two_turns():
    assert PromptConfig().history_turns == 2
    assert _turns_shown(_user(_history(6))) == [5, 6]


def test_past_observations_are_cut_current_is_not():
    cfg = PromptConfig(history_obs_chars=50, history_turns=-1)
    long_obs = "<obs01>" + "".join(chr(ord("a") + i % 26) for i in range(200))
    exact = "<obs02>" + "y" * 43  # exactly 50 characters: kept whole
    history = [{"observation": long_obs, "action": "click[act01]"}, {"observation": exact, "action": "click[act02]"}]
    current = "CURRENT " + "z" * 300
    user = _user(history, cfg, observation=current)
    assert f"[turn 1] observation: {long_obs[:50]} ...\n" in user
    assert long_obs[:51] not in user
    assert f"[turn 2] observation: {exact}\n" in user and exact + " ..." not in user
    assert f"Current observation: {current}\n" in user  # the current page is shown whole


def test_default_obs_cut_is_400_chars():
    obs = "<obs01>" + "q" * 600
    user = _user([{"observation": obs, "action": "click[act01]"}])
    assert obs[:400] + " ...\n" in user and obs[:401] not in user


@pytest.mark.parametrize(
    "n,cap,listed,more", [(50, 40, 40, 10), (40, 40, 40, 0), (3, 40, 3, 0), (10, 4, 4, 6), (1, 1, 1, 0)]
)
def test_admissible_actions_capped(n, cap, listed, more):
    actions = [f"click[item-{i:03d}]" for i in range(n)]
    user = _user([], PromptConfig(max_admissible=cap), admissible=actions)
    line = user.split("\n")[-1]
    assert line.startswith("Admissible actions: ")
    body = line[len("Admissible actions: ") :]
    if more:
        assert body.endswith(f" (and {more} more)")
        body = body[: -len(f" (and {more} more)")]
    else:
        assert "more)" not in body
    assert body.split(", ") == actions[:listed]


def test_no_admissible_line_when_none():
    user = _user([], admissible=[])
    assert "Admissible actions" not in user
    assert user.split("\n")[-1] == "Turn 1. Current observation: PAGE NOW"


def test_build_messages_does_not_touch_history():
    history = _history(4, obs_len=900)
    before = [dict(t) for t in history]
    _user(history)
    assert history == before


# ---------------------------------------------------------------- render_prompt_ids


def test_render_prompt_ids_round_trips_chatml(tiny_tokenizer):
    tok = tiny_tokenizer
    history = [{"observation": "WebShop [SEP] Search", "action": "search[blue  mug, 12 oz]"}]
    messages = build_messages(
        RULES,
        "i need a blue mug — café style ",
        history,
        "Instruction: [SEP] i need a blue mug [SEP] Back to Search [SEP] B0X9 [SEP] $9.99",
        ["click[back to search]", "click[b0x9]"],
        PromptConfig(),
    )
    ids = render_prompt_ids(tok, messages)
    assert isinstance(ids, list) and ids and all(type(i) is int for i in ids)
    expected = (
        f"<|im_start|>system\n{messages[0]['content']}<|im_end|>\n"
        f"<|im_start|>user\n{messages[1]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    text = tok.decode(ids)
    assert text == expected
    assert text.endswith("<|im_start|>assistant\n")
    # the special tokens are single ids, not spelled out in bytes
    im_start, im_end = tok.convert_tokens_to_ids("<|im_start|>"), tok.convert_tokens_to_ids(EOS_TOKEN)
    assert ids.count(im_start) == 3 and ids.count(im_end) == 2
    assert ids[0] == im_start
    # the same ids as encoding the rendered text directly
    assert ids == tok(expected, add_special_tokens=False)["input_ids"]
    # without the special tokens the text is the two messages' contents
    assert tok.decode(ids, skip_special_tokens=True) == (
        f"system\n{messages[0]['content']}\nuser\n{messages[1]['content']}\nassistant\n"
    )


def test_render_prompt_ids_deterministic(tiny_tokenizer):
    messages = build_messages(RULES, "buy a mug", _history(3), "PAGE NOW", ["click[buy now]"], PromptConfig())
    assert render_prompt_ids(tiny_tokenizer, messages) == render_prompt_ids(tiny_tokenizer, [dict(m) for m in messages])


def test_an_environment_sets_its_own_action_example_and_bare_form():
    import re

    from envs.base import ActionFormat

    alf = ActionFormat(example="go to countertop 1", bare=re.compile(r"[a-z][a-z0-9 /'-]*"))
    system = build_messages("rules", "task", [], "obs", [], PromptConfig(), alf)[0]["content"]
    assert system.endswith("for example <action>go to countertop 1</action>.") and "click[" not in system
    # the same bare reply is an action in one environment and malformed in another
    assert parse_action("go to desk 1", alf) == ("go to desk 1", None)
    action, error = parse_action("go to desk 1")
    assert action == "go to desk 1" and "malformed action" in error
    assert action_span("  go to desk 1\n", alf) == (2, 14)
    assert action_span("go to desk 1") is None
    # tags win over the bare form in every environment
    assert parse_action("think <action>open drawer 1</action>", alf) == ("open drawer 1", None)
