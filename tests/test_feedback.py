"""Feedback sources and hindsight blocks (serl_cli.method.feedback, METHOD.md 3-4). Fast: hand-made
rollout records, no model; one small trained tokenizer for the cutter."""

from __future__ import annotations

from dataclasses import replace

import pytest

from envs.base import state_key
from serl_cli.artifacts.records import Episode, Turn
from serl_cli.errors import SerlError
from serl_cli.method import feedback as fb
from serl_cli.method.anchors import anchor_groups, hindsight_anchor
from serl_cli.method.feedback import TurnContext, hindsight_step, parse_sources


def turn(action, state, *, error=None, diff="", obs=None, observation=None):
    """One turn as serl_cli.rollout.runner records it (token fields left empty)."""
    return Turn(
        observation=observation or f"page {state}",
        state_key=state,
        expert_action=None,
        prompt_ids=[],
        action_ids=[],
        action_text=f"<action>{action}</action>",
        action=action,
        behaviour_logprobs=[],
        next_observation=obs if obs is not None else f"after {action}",
        feedback={"error": error, "diff": diff},
        reward=0.0,
        done=False,
    )


def episode(index, turns, *, success=False, reward=None, task_id=7, group_id=0):
    return Episode(
        task_id=task_id,
        group_id=group_id,
        rollout_index=index,
        turns=turns,
        success=success,
        reward=reward if reward is not None else float(success),
    )


def ctx(ep, t, group=None, **kw):
    return TurnContext(episode=ep, turn=t, group=group if group is not None else [ep], **kw)


def render(name, c):
    return fb.SOURCES[name].render(c), fb.SOURCES[name].fires(c)


# A failed rollout: search, a wrong click that the page ignores, an invalid click.
FAILED = episode(
    0,
    [
        turn("search[red mug]", "s0", diff="page search -> results; listed: B1, B2"),
        turn("click[b9]", "s1", diff="no change"),
        turn("click[bogus]", "s1", error="no button 'bogus' on this page", diff="no change"),
    ],
)

# ------------------------------------------------------------------ error / diff / obs


def test_error_renders_and_fires_only_when_present():
    assert render("error", ctx(FAILED, 2)) == (
        "Environment error at the current step:\nno button 'bogus' on this page",
        True,
    )
    assert render("error", ctx(FAILED, 0)) == (None, False)


def test_diff_renders_changes_and_fires_only_on_no_change():
    assert render("diff", ctx(FAILED, 0)) == (
        "What changed after the current step:\npage search -> results; listed: B1, B2",
        False,
    )
    assert render("diff", ctx(FAILED, 1)) == ("What changed after the current step:\nno change", True)
    assert render("diff", ctx(episode(0, [turn("click[x]", "s", diff="")]), 0)) == (None, False)


def test_obs_is_the_raw_answer_under_the_authors_title_and_never_fires():
    # the authors' default mode, immediate_feedback: "Immediate feedback from the current step:" (PC:1634-1637)
    ep = episode(0, [turn("click[x]", "s", error="bad", obs="  alpha beta gamma\n")])
    assert render("obs", ctx(ep, 0)) == ("Immediate feedback from the current step:\nalpha beta gamma", False)
    assert render("obs", ctx(episode(0, [turn("click[x]", "s", obs="  ")]), 0)) == (None, False)  # empty: no section


# ------------------------------------------------------------------ future


def test_future_lists_only_the_later_turns_without_outcome():
    assert render("future", ctx(FAILED, 0)) == (
        (
            "Observed future trajectory of the current step:\n"
            "Step 2\nResponse:\n<action>click[b9]</action>\n\n"
            "Step 3\nResponse:\n<action>click[bogus]</action>"
        ),
        False,
    )
    text, _ = render("future", ctx(FAILED, 1))
    assert "click[b9]" not in text and "Step 2" not in text and text.endswith("<action>click[bogus]</action>")
    won = episode(1, [turn("search[mug]", "s0"), turn("click[buy now]", "s1")], success=True, reward=1.0)
    text, _ = render("future", ctx(won, 0))
    assert "succeeded" not in text and "reward" not in text and "1.00" not in text
    assert render("future", ctx(won, 1)) == (None, False)  # the last turn has no future


def test_future_drops_reasoning_from_the_later_replies():
    ep = episode(
        0, [turn("up", "s0"), replace(turn("left", "s1"), action_text="<think>go round</think>\n<action>left</action>")]
    )
    assert (
        render("future", ctx(ep, 0))[0]
        == "Observed future trajectory of the current step:\nStep 2\nResponse:\n<action>left</action>"
    )


# ------------------------------------------------------------------ ref / expert

WIN1 = episode(
    1,
    [
        turn("search[red mug]", "s0", diff="page search -> results"),
        turn("click[b2]", "s1", diff="opened B2"),
        turn("click[buy now]", "s2", diff="bought B2, score 1.000"),
    ],
    success=True,
)
WIN3 = episode(3, [turn("search[mug]", "s0"), turn("click[b1]", "s1"), turn("click[buy now]", "s3")], success=True)
LOST2 = episode(2, [turn("search[cup]", "s5")])
EXPERT = [
    {"observation": "page s0", "action": "search[red mug]", "state_key": "s0"},
    {"observation": "page s1", "action": "click[b1]", "state_key": "s1"},
    {"observation": "page s4", "action": "click[buy now]", "state_key": "s4"},
]
WIN1_TEXT = (
    "Successful trajectory in the same task, if any:\n"
    "Step 1\nResponse:\n<action>search[red mug]</action>\n\n"
    "Step 2\nResponse:\n<action>click[b2]</action>\n\n"
    "Step 3\nResponse:\n<action>click[buy now]</action>"
)


def test_ref_is_the_whole_trajectory_of_the_first_successful_sibling_by_rollout_index():
    group = [FAILED, WIN3, LOST2, WIN1]
    assert render("ref", ctx(FAILED, 1, group, expert=EXPERT)) == (WIN1_TEXT, True)  # the sibling clicked b2, not b9
    assert render("ref", ctx(FAILED, 2, group))[0] == WIN1_TEXT  # the same whole trajectory for every turn


def test_ref_of_a_successful_rollout_is_another_success_never_itself():
    # dont_reprompt_on_self_success (PC:633-659): only the rollout itself is left out
    assert render("ref", ctx(WIN3, 1, [WIN3, WIN1]))[0] == WIN1_TEXT
    assert render("ref", ctx(WIN1, 0, [FAILED, WIN3, WIN1]))[0].startswith(
        "Successful trajectory in the same task, if any:\nStep 1\nResponse:\n<action>search[mug]</action>"
    )
    assert render("ref", ctx(WIN1, 0, [FAILED, WIN1])) == (None, False)  # the only success: nothing


def test_ref_fires_only_on_disagreement():
    group = [FAILED, WIN1]
    assert render("ref", ctx(FAILED, 0, group))[1] is False  # both searched "red mug"
    agrees = episode(0, [turn("SEARCH[red  mug]", "s0")])  # case and spacing do not count
    assert render("ref", ctx(agrees, 0, [agrees, WIN1]))[1] is False
    assert render("ref", ctx(FAILED, 1, group))[1] is True


def test_ref_fires_against_the_last_visit_of_a_revisited_state():
    looped = episode(
        1,
        [turn("click[b1]", "s1"), turn("click[back]", "s0"), turn("click[b2]", "s1"), turn("click[buy now]", "s2")],
        success=True,
    )
    assert render("ref", ctx(episode(0, [turn("click[b1]", "s1")]), 0, None))[0] is None
    lost = episode(0, [turn("click[b1]", "s1")])
    assert render("ref", ctx(lost, 0, [lost, looped]))[1] is True  # its last visit clicked b2
    lost_b2 = episode(0, [turn("click[b2]", "s1")])
    assert render("ref", ctx(lost_b2, 0, [lost_b2, looped]))[1] is False


def test_ref_never_falls_back_to_the_expert():
    assert render("ref", ctx(FAILED, 1, [FAILED, LOST2], expert=EXPERT)) == (None, False)


def test_ref_without_the_state_fires_against_the_same_index_or_not_at_all():
    off = episode(0, [turn("search[x]", "z0"), turn("click[y]", "z1"), turn("click[z]", "z2"), turn("click[w]", "z3")])
    assert render("ref", ctx(off, 1, [off, WIN1])) == (WIN1_TEXT, True)
    assert render("ref", ctx(off, 3, [off, WIN1])) == (WIN1_TEXT, False)  # the reference is shorter: no matching point


def test_expert_is_its_own_source_labelled_privileged():
    text, fires = render("expert", ctx(FAILED, 1, [FAILED, WIN1], expert=EXPERT))
    assert (
        text
        == (
            "Expert demonstration for this task (privileged oracle information):\n"
            "Step 1\nResponse:\n<action>search[red mug]</action>\n\n"
            "Step 2\nResponse:\n<action>click[b1]</action>\n\n"
            "Step 3\nResponse:\n<action>click[buy now]</action>"
        )
        and fires
    )  # the expert clicked b1, not b9
    assert render("expert", ctx(FAILED, 0, expert=EXPERT))[1] is False  # both searched "red mug"
    assert render("expert", ctx(FAILED, 0)) == (None, False)  # no demonstration known


def test_expert_state_key_is_computed_from_the_observation_when_absent():
    obs = "WebShop [SEP] Search"
    lost = episode(0, [turn("click[x]", state_key(obs), observation=obs)])
    text, fires = render("expert", ctx(lost, 0, expert=[{"observation": obs, "action": "search[mug]"}]))
    assert text.endswith("<action>search[mug]</action>") and fires


def test_turn_context_has_no_ref_mode_any_more():
    with pytest.raises(TypeError):
        ctx(FAILED, 0, ref_mode="expert")


# ------------------------------------------------------------------ parse_sources


@pytest.mark.parametrize(
    "spec,parsed",
    [
        ("error", [["error"]]),
        ("error,ref", [["error"], ["ref"]]),
        ("ref|error", [["ref", "error"]]),
        (" ref | error , diff ", [["ref", "error"], ["diff"]]),
        ("obs,future", [["obs"], ["future"]]),
    ],
)
def test_parse_sources(spec, parsed):
    assert parse_sources(spec) == parsed


@pytest.mark.parametrize(
    "spec,problem",
    [
        ("ref|", "empty source name"),
        (",error", "empty source name"),
        ("error,,diff", "empty source name"),
        ("", "no feedback sources"),
        ("   ", "no feedback sources"),
        ("ref|eror", "unknown feedback source 'eror'"),
        ("error,error", "named twice"),
    ],
)
def test_parse_sources_rejects(spec, problem):
    with pytest.raises(SerlError) as e:
        parse_sources(spec)
    msg = str(e.value)
    assert problem in msg and "\n" not in msg
    if "named twice" not in problem:
        assert "known sources: error, diff, obs, future, ref, expert" in msg


# ------------------------------------------------------------------ hindsight_step


def test_step_block_is_the_sections_in_spec_order_a_blank_line_apart():
    text, used, fired = hindsight_step(ctx(FAILED, 2, [FAILED, WIN1]), "error,diff,ref")
    assert text == (
        "Environment error at the current step:\nno button 'bogus' on this page\n\n"
        "What changed after the current step:\nno change\n\n" + WIN1_TEXT
    )
    assert used == ["error", "diff", "ref"] and fired == ["error", "diff", "ref"]


def test_step_fallback_uses_error_where_no_ref_exists():
    spec = parse_sources("ref|error")
    assert hindsight_step(ctx(FAILED, 2, [FAILED, LOST2]), spec) == (
        "Environment error at the current step:\nno button 'bogus' on this page",
        ["error"],
        ["error"],
    )
    text, used, fired = hindsight_step(ctx(FAILED, 2, [FAILED, WIN1]), spec)  # a ref exists: it wins
    assert used == ["ref"] and fired == ["ref"] and "Environment error" not in text
    assert hindsight_step(ctx(FAILED, 0, [FAILED, LOST2]), spec) == (None, [], [])  # nothing to say


def test_step_counts_a_rendered_source_that_does_not_fire():
    assert hindsight_step(ctx(FAILED, 0), "diff,obs,future")[1:] == (["diff", "obs", "future"], [])


# ------------------------------------------------------------------ cutters

TEXTS = [
    "short",
    "a mug of tea",
    "café crème brûlée naïve façade déjà vu " * 4,
    "漢字 かな 混じり の 文 " * 6,
    "emoji 🙂 rocket 🚀 party 🎉 words " * 5,
    "Instruction: [SEP] i need a lightweight navy blue hair dryer [SEP] Back to Search [SEP] Page 1 " * 3,
]


def _ends_cleanly(out: str, text: str) -> bool:
    """Unchanged, or a prefix of ``text`` + " ..." that ends on a word boundary -- unless the
    prefix has no whitespace in its last max(20 %, 16 chars) (a run too long to drop stays cut)."""
    if out == text:
        return True
    head = out[: -len(" ...")]
    if not (out.endswith(" ...") and text.startswith(head) and not head.endswith("\ufffd")):
        return False
    on_boundary = len(head) == 0 or text[len(head)].isspace()
    tail = head[len(head) - int(max(0.2 * len(head), fb.TAIL_CHARS)) :]
    return on_boundary or not any(c.isspace() for c in tail)


@pytest.mark.parametrize("budget", [5, 8, 12, 20, 33, 60, 400])
def test_char_cutter(budget):
    cut = fb.char_cutter(budget)
    for text in TEXTS:
        out = cut(text)
        assert len(out) <= budget and _ends_cleanly(out, text), (text, out)
        if len(text) <= budget:
            assert out == text


def test_char_cutter_keeps_a_long_unbroken_tail_cut():
    assert fb.char_cutter(40)("ab " + "x" * 60) == "ab " + "x" * 33 + " ..."  # no space near the end: cut mid-run
    assert fb.char_cutter(40)("ab " + "x" * 20 + " yyyyyyyyyyyyyyyyyyyy") == "ab " + "x" * 20 + " ..."


@pytest.fixture(scope="module")
def tokenizer():
    from serl_cli.models.tiny import train_tokenizer

    # ASCII only: accented letters, kana and emoji split into byte tokens, so cuts can fall mid-character
    return train_tokenizer(
        [t for t in TEXTS if t.isascii()] * 3 + ["the quick brown fox jumps over the lazy dog"] * 5, 300
    )


def test_token_cutter_never_ends_mid_character(tokenizer):
    text = TEXTS[4]
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert any(tokenizer.decode(ids[:n]).endswith("\ufffd") for n in range(len(ids)))  # raw prefixes do
    for n in range(3, 40):
        assert not fb.make_cutter(tokenizer, n)(text)[:-4].endswith("\ufffd")


@pytest.mark.parametrize("budget", [3, 6, 10, 17, 25, 40, 1000])
def test_token_cutter(tokenizer, budget):
    cut = fb.make_cutter(tokenizer, budget)
    for text in TEXTS:
        out = cut(text)
        assert len(tokenizer.encode(out, add_special_tokens=False)) <= budget, (text, out)
        assert _ends_cleanly(out, text) or (out == "" and budget < 4), (text, out)  # no room for " ..."
        if len(tokenizer.encode(text, add_special_tokens=False)) <= budget:
            assert out == text


@pytest.mark.parametrize("budget", [3, 10, 25, 1000])
def test_cutting_a_batch_equals_cutting_each(tokenizer, budget):
    """The annotation cuts every block of a batch in one tokenizer call: the same strings as one at a time."""
    texts = TEXTS + ["", TEXTS[0]]
    assert fb.cut_all(tokenizer, budget, texts) == [fb.make_cutter(tokenizer, budget)(t) for t in texts]
    assert fb.cut_all(tokenizer, budget, []) == []


# ------------------------------------------------------------------ anchors


def test_anchor_groups_by_state_key():
    a = episode(0, [turn("x", "s0"), turn("y", "s1")])
    b = episode(1, [turn("x", "s0"), turn("z", "s2"), turn("w", "s1")])
    assert anchor_groups([a, b]) == {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 2, (1, 2): 1}


def test_anchor_groups_by_similarity_are_transitive():
    obs = [
        "red mug blue cup green bowl",
        "red mug blue cup green plate",
        "red mug blue cup tin plate",
        "nothing alike here",
    ]
    eps = [episode(i, [turn("x", f"s{i}", observation=o)]) for i, o in enumerate(obs)]
    # Jaccard: 0-1 = 5/7, 1-2 = 5/7, 0-2 = 4/8: 0 and 2 join only through 1
    assert anchor_groups(eps) == {(0, 0): 0, (1, 0): 1, (2, 0): 2, (3, 0): 3}
    assert anchor_groups(eps, 0.7) == {(0, 0): 0, (1, 0): 0, (2, 0): 0, (3, 0): 1}
    assert anchor_groups(eps, 0.8) == anchor_groups(eps)
    with pytest.raises(SerlError, match="similarity"):
        anchor_groups(eps, 0.0)
    with pytest.raises(ValueError):
        anchor_groups([eps[0], episode(1, [], task_id=8)])


def test_anchor_block_pools_sibling_errors_and_successful_actions():
    me = episode(0, [turn("click[bogus]", "s1", error="no button 'bogus'", diff="no change")])
    sib_a = episode(1, [turn("click[bogus]", "s1", error="no button 'bogus'", diff="no change")])
    sib_b = episode(2, [turn("click[bogus]", "s1", error="no button 'bogus'", diff="no change")])
    sib_c = episode(3, [turn("click[lamp]", "s1", error="no button 'lamp'", diff="no change")])
    win4 = episode(4, [turn("click[b1]", "s1", diff="opened B1"), turn("click[buy now]", "s2")], success=True)
    win5 = episode(5, [turn("CLICK[b1]", "s1", diff="opened B1")], success=True)
    group = [me, sib_a, sib_b, sib_c, win4, win5]
    anchors = anchor_groups(group)
    text, used, fired = hindsight_anchor(ctx(me, 0, group), "error,ref", anchors)
    assert text == (
        "Errors other attempts got here:\n"
        "click[bogus] (2 attempts): no button 'bogus'\n"
        "click[lamp] (1 attempt): no button 'lamp'\n\n"
        "What successful attempts did from this state:\n"
        "click[b1] (rollout 4, rollout 5)"
    )
    assert used == ["error", "ref"] and fired == ["error", "ref"]
    # a successful rollout sees the others' errors and the OTHER success's action, which agrees with its own
    text, used, fired = hindsight_anchor(ctx(win4, 0, group), "error,ref", anchors)
    assert used == ["error", "ref"] and fired == [] and "(3 attempts)" in text and "(rollout 5)" in text
    assert "rollout 4" not in text


def test_anchor_fires_nothing_when_others_differ_and_winners_agree():
    me = episode(0, [turn("click[b1]", "s1", diff="opened B1")])
    other = episode(1, [turn("click[b7]", "s1", diff="no change")])
    win = episode(2, [turn("click[b1]", "s1", diff="opened B1")], success=True)
    group = [me, other, win]
    text, used, fired = hindsight_anchor(ctx(me, 0, group), "diff,ref", anchor_groups(group))
    assert used == ["diff", "ref"] and fired == []
    assert "click[b7] (1 attempt): no change\nclick[b1] (1 attempt): opened B1" in text


def test_anchor_ref_never_uses_the_expert_which_is_its_own_source():
    me = episode(0, [turn("click[x]", "s1", diff="no change")])
    other = episode(1, [turn("click[y]", "s1", diff="no change")])
    group = [me, other]
    anchors = anchor_groups(group)
    assert hindsight_anchor(ctx(me, 0, group, expert=EXPERT), "ref", anchors) == (None, [], [])
    text, used, fired = hindsight_anchor(ctx(me, 0, group, expert=EXPERT), "expert,future", anchors)
    assert text == "The expert's action from this state (privileged oracle information):\nclick[b1]"
    assert used == ["expert"] and fired == ["expert"]  # the last turn: no future


def test_anchor_future_renders_as_in_step():
    me = episode(0, [turn("click[x]", "s1"), turn("click[y]", "s2")])
    other = episode(1, [turn("click[z]", "s1")])
    group = [me, other]
    c = ctx(me, 0, group)
    assert hindsight_anchor(c, "future", anchor_groups(group)) == hindsight_step(c, "future")


def test_anchor_expert_keys_steps_without_a_state_key_by_their_observation():
    # expert data recorded without state keys: each step is keyed by its observation's hash, as in step granularity
    from envs.base import state_key

    expert = [{"observation": s["observation"], "action": s["action"]} for s in EXPERT]
    me = episode(0, [turn("click[x]", state_key("page s1"), diff="no change")])
    other = episode(1, [turn("click[y]", state_key("page s1"), diff="no change")])
    group = [me, other]
    text, used, fired = hindsight_anchor(ctx(me, 0, group, expert=expert), "expert", anchor_groups(group))
    assert text.endswith("click[b1]") and used == ["expert"] and fired == ["expert"]


def test_anchor_singleton_falls_back_to_step():
    group = [FAILED, LOST2]
    anchors = anchor_groups(group)
    for t in range(3):
        c = ctx(FAILED, t, group, expert=EXPERT)
        if sum(a == anchors[(0, t)] for a in anchors.values()) == 1:
            assert hindsight_anchor(c, "ref|error", anchors) == hindsight_step(c, "ref|error")
