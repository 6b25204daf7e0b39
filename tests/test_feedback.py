"""Feedback sources and hindsight blocks (serl_cli.method.feedback, METHOD.md 3-4). Fast: hand-made
rollout records, no model; one small trained tokenizer for the cutter."""

from __future__ import annotations

import pytest

from envs.base import state_key
from serl_cli.errors import SerlError
from serl_cli.method import feedback as fb
from serl_cli.method.anchors import anchor_groups, hindsight_anchor
from serl_cli.method.feedback import TurnContext, hindsight_step, parse_sources


def turn(action, state, *, error=None, diff="", obs=None, observation=None):
    """One turn as serl_cli.rollout.runner records it (token fields left empty)."""
    return {"observation": observation or f"page {state}", "state_key": state, "expert_action": None,
            "prompt_ids": [], "action_ids": [], "action_text": f"<action>{action}</action>", "action": action,
            "behaviour_logprobs": [], "next_observation": obs if obs is not None else f"after {action}",
            "feedback": {"error": error, "diff": diff}, "reward": 0.0, "done": False}


def episode(index, turns, *, success=False, reward=None, task_id=7, group_id=0):
    return {"task_id": task_id, "group_id": group_id, "rollout_index": index, "turns": turns,
            "success": success, "reward": reward if reward is not None else float(success)}


def ctx(ep, t, group=None, **kw):
    return TurnContext(episode=ep, turn=t, group=group if group is not None else [ep], **kw)


def render(name, c):
    return fb.SOURCES[name].render(c), fb.SOURCES[name].fires(c)


# A failed rollout: search, a wrong click that the page ignores, an invalid click.
FAILED = episode(0, [
    turn("search[red mug]", "s0", diff="page search -> results; listed: B1, B2"),
    turn("click[b9]", "s1", diff="no change"),
    turn("click[bogus]", "s1", error="no button 'bogus' on this page", diff="no change"),
])

# ------------------------------------------------------------------ error / diff / obs


def test_error_renders_and_fires_only_when_present():
    assert render("error", ctx(FAILED, 2)) == ("Environment error: no button 'bogus' on this page", True)
    assert render("error", ctx(FAILED, 0)) == (None, False)


def test_diff_renders_changes_and_fires_only_on_no_change():
    assert render("diff", ctx(FAILED, 0)) == ("What changed: page search -> results; listed: B1, B2", False)
    assert render("diff", ctx(FAILED, 1)) == ("What changed: no change", True)
    assert render("diff", ctx(episode(0, [turn("click[x]", "s", diff="")]), 0)) == (None, False)


def test_obs_is_cut_to_the_budget_and_never_fires():
    ep = episode(0, [turn("click[x]", "s", error="bad", obs="alpha beta gamma delta epsilon zeta eta theta")])
    text, fires = render("obs", ctx(ep, 0, cut=fb.char_cutter(24)))
    assert text == "Next observation: alpha beta gamma ..." and not fires  # an error does not make obs fire
    assert render("obs", ctx(ep, 0))[0] == "Next observation: alpha beta gamma delta epsilon zeta eta theta"


def test_future_lists_the_rest_of_the_rollout_and_its_outcome():
    assert render("future", ctx(FAILED, 1)) == (
        "What happened next (this attempt failed, reward 0.00):\n"
        "  turn 2: click[b9] -> no change\n"
        "  turn 3: click[bogus] -> error: no button 'bogus' on this page", False)
    won = episode(1, [turn("click[buy now]", "s", diff="page item -> done; bought B1, score 1.000")], success=True)
    assert render("future", ctx(won, 0))[0] == ("What happened next (this attempt succeeded, reward 1.00):\n"
                                                 "  turn 1: click[buy now] -> page item -> done; bought B1, score 1.000")


# ------------------------------------------------------------------ ref

WIN1 = episode(1, [turn("search[red mug]", "s0", diff="page search -> results"), turn("click[b2]", "s1", diff="opened B2"),
                   turn("click[buy now]", "s2", diff="bought B2, score 1.000")], success=True)
WIN3 = episode(3, [turn("search[mug]", "s0"), turn("click[b1]", "s1"), turn("click[buy now]", "s3")], success=True)
LOST2 = episode(2, [turn("search[cup]", "s5")])
EXPERT = [{"observation": "page s0", "action": "search[red mug]", "state_key": "s0"},
          {"observation": "page s1", "action": "click[b1]", "state_key": "s1"},
          {"observation": "page s4", "action": "click[buy now]", "state_key": "s4"}]


def test_ref_takes_the_lowest_successful_sibling_from_the_matching_state():
    group = [FAILED, WIN3, LOST2, WIN1]
    assert render("ref", ctx(FAILED, 1, group, expert=EXPERT)) == (
        "A successful attempt (rollout 1), from this same state on:\n"
        "  turn 2: click[b2] -> opened B2\n"
        "  turn 3: click[buy now] -> bought B2, score 1.000", True)  # the sibling clicked b2, not b9
    # matched by state, not by index: turn 3 (state s1) is read from the reference's turn 2
    assert render("ref", ctx(FAILED, 2, group))[0].startswith("A successful attempt (rollout 1), from this same state on:\n"
                                                              "  turn 2: click[b2]")


def test_ref_fires_only_on_disagreement():
    group = [FAILED, WIN1]
    assert render("ref", ctx(FAILED, 0, group))[1] is False  # both searched "red mug"
    agrees = episode(0, [turn("SEARCH[red  mug]", "s0")])  # case and spacing do not count
    assert render("ref", ctx(agrees, 0, [agrees, WIN1]))[1] is False
    assert render("ref", ctx(FAILED, 1, group))[1] is True


def test_ref_uses_the_last_visit_of_a_revisited_state():
    looped = episode(1, [turn("click[b1]", "s1"), turn("click[back]", "s0"), turn("click[b2]", "s1"),
                         turn("click[buy now]", "s2")], success=True)
    lost = episode(0, [turn("click[b1]", "s1")])
    text, fires = render("ref", ctx(lost, 0, [lost, looped]))
    assert text == ("A successful attempt (rollout 1), from this same state on:\n"
                    "  turn 3: click[b2]\n  turn 4: click[buy now]") and fires


def test_ref_falls_back_to_the_expert_when_no_sibling_succeeded():
    text, fires = render("ref", ctx(FAILED, 1, [FAILED, LOST2], expert=EXPERT))
    assert text == ("The expert's demonstration, from this same state on:\n"
                    "  turn 2: click[b1]\n  turn 3: click[buy now]") and fires
    assert render("ref", ctx(FAILED, 1, [FAILED, LOST2])) == (None, False)  # nothing to refer to


def test_expert_state_key_is_computed_from_the_observation_when_absent():
    obs = "WebShop [SEP] Search"
    lost = episode(0, [turn("click[x]", state_key(obs), observation=obs)])
    text, _ = render("ref", ctx(lost, 0, expert=[{"observation": obs, "action": "search[mug]"}]))
    assert text == "The expert's demonstration, from this same state on:\n  turn 1: search[mug]"


def test_ref_mode_expert_ignores_successful_siblings():
    text, _ = render("ref", ctx(FAILED, 0, [FAILED, WIN1], expert=EXPERT, ref_mode="expert"))
    assert text.startswith("The expert's demonstration, from this same state on:\n  turn 1: search[red mug]")
    with pytest.raises(SerlError, match="ref_mode"):
        ctx(FAILED, 0, ref_mode="sibling")


def test_ref_is_never_used_for_a_successful_rollout():
    assert render("ref", ctx(WIN3, 1, [WIN3, WIN1], expert=EXPERT)) == (None, False)


def test_ref_without_the_state_reads_the_same_index_or_the_whole_trajectory():
    off = episode(0, [turn("search[x]", "z0"), turn("click[y]", "z1"), turn("click[z]", "z2"), turn("click[w]", "z3")])
    text, fires = render("ref", ctx(off, 1, [off, WIN1]))
    assert text == ("A successful attempt (rollout 1), from its turn 2 on (it never saw this state):\n"
                    "  turn 2: click[b2] -> opened B2\n  turn 3: click[buy now] -> bought B2, score 1.000") and fires
    text, fires = render("ref", ctx(off, 3, [off, WIN1]))  # the reference is shorter: all of it, no matching point
    assert text.startswith("A successful attempt (rollout 1), in full (it never saw this state):\n  turn 1: search[red mug]")
    assert not fires


# ------------------------------------------------------------------ parse_sources


@pytest.mark.parametrize("spec,parsed", [
    ("error", [["error"]]),
    ("error,ref", [["error"], ["ref"]]),
    ("ref|error", [["ref", "error"]]),
    (" ref | error , diff ", [["ref", "error"], ["diff"]]),
    ("obs,future", [["obs"], ["future"]]),
])
def test_parse_sources(spec, parsed):
    assert parse_sources(spec) == parsed


@pytest.mark.parametrize("spec,problem", [
    ("ref|", "empty source name"), (",error", "empty source name"), ("error,,diff", "empty source name"),
    ("", "no feedback sources"), ("   ", "no feedback sources"), ("ref|eror", "unknown feedback source 'eror'"),
    ("error,error", "named twice"),
])
def test_parse_sources_rejects(spec, problem):
    with pytest.raises(SerlError) as e:
        parse_sources(spec)
    msg = str(e.value)
    assert problem in msg and "\n" not in msg
    if "named twice" not in problem:
        assert "known sources: error, diff, obs, future, ref" in msg


# ------------------------------------------------------------------ hindsight_step


def test_step_block_combines_sources_in_spec_order():
    text, used, fired = hindsight_step(ctx(FAILED, 2, [FAILED, WIN1]), "error,diff,ref")
    assert text == ("[Hindsight: what the environment revealed about this step]\n"
                    "Environment error: no button 'bogus' on this page\n"
                    "What changed: no change\n"
                    "A successful attempt (rollout 1), from this same state on:\n"
                    "  turn 2: click[b2] -> opened B2\n  turn 3: click[buy now] -> bought B2, score 1.000")
    assert used == ["error", "diff", "ref"] and fired == ["error", "diff", "ref"]


def test_step_fallback_uses_error_where_no_ref_exists():
    spec = parse_sources("ref|error")
    assert hindsight_step(ctx(FAILED, 2, [FAILED, LOST2]), spec) == (
        "[Hindsight: what the environment revealed about this step]\n"
        "Environment error: no button 'bogus' on this page", ["error"], ["error"])
    text, used, fired = hindsight_step(ctx(FAILED, 2, [FAILED, WIN1]), spec)  # a ref exists: it wins
    assert used == ["ref"] and fired == ["ref"] and "Environment error" not in text
    assert hindsight_step(ctx(FAILED, 0, [FAILED, LOST2]), spec) == (None, [], [])  # nothing to say


def test_step_counts_a_rendered_source_that_does_not_fire():
    assert hindsight_step(ctx(FAILED, 0), "diff,obs,future")[1:] == (["diff", "obs", "future"], [])


# ------------------------------------------------------------------ cutters

TEXTS = ["short", "a mug of tea", "café crème brûlée naïve façade déjà vu " * 4, "漢字 かな 混じり の 文 " * 6,
         "emoji 🙂 rocket 🚀 party 🎉 words " * 5,
         "Instruction: [SEP] i need a lightweight navy blue hair dryer [SEP] Back to Search [SEP] Page 1 " * 3]


def _ends_cleanly(out: str, text: str) -> bool:
    """Unchanged, or a prefix of ``text`` + " ..." that ends on a word boundary -- unless the
    prefix has no whitespace in its last max(20 %, 16 chars) (a run too long to drop stays cut)."""
    if out == text:
        return True
    head = out[:-len(" ...")]
    if not (out.endswith(" ...") and text.startswith(head) and not head.endswith("\ufffd")):
        return False
    on_boundary = len(head) == 0 or text[len(head)].isspace()
    tail = head[len(head) - int(max(0.2 * len(head), fb.TAIL_CHARS)):]
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
    return train_tokenizer([t for t in TEXTS if t.isascii()] * 3 + ["the quick brown fox jumps over the lazy dog"] * 5, 300)


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


# ------------------------------------------------------------------ anchors


def test_anchor_groups_by_state_key():
    a = episode(0, [turn("x", "s0"), turn("y", "s1")])
    b = episode(1, [turn("x", "s0"), turn("z", "s2"), turn("w", "s1")])
    assert anchor_groups([a, b]) == {(0, 0): 0, (0, 1): 1, (1, 0): 0, (1, 1): 2, (1, 2): 1}


def test_anchor_groups_by_similarity_are_transitive():
    obs = ["red mug blue cup green bowl", "red mug blue cup green plate", "red mug blue cup tin plate", "nothing alike here"]
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
    assert text == ("[Hindsight: what attempts from this same state revealed]\n"
                    "Errors other attempts got here:\n"
                    "  click[bogus] (2 attempts): no button 'bogus'\n"
                    "  click[lamp] (1 attempt): no button 'lamp'\n"
                    "What successful attempts did from this state:\n"
                    "  click[b1] (rollout 4, rollout 5)")
    assert used == ["error", "ref"] and fired == ["error", "ref"]
    # the successful rollout sees the others' errors but no ref, and took no failing action itself
    text, used, fired = hindsight_anchor(ctx(win4, 0, group), "error,ref", anchors)
    assert used == ["error"] and fired == [] and "(3 attempts)" in text


def test_anchor_fires_nothing_when_others_differ_and_winners_agree():
    me = episode(0, [turn("click[b1]", "s1", diff="opened B1")])
    other = episode(1, [turn("click[b7]", "s1", diff="no change")])
    win = episode(2, [turn("click[b1]", "s1", diff="opened B1")], success=True)
    group = [me, other, win]
    text, used, fired = hindsight_anchor(ctx(me, 0, group), "diff,ref", anchor_groups(group))
    assert used == ["diff", "ref"] and fired == []
    assert "  click[b7] (1 attempt): no change\n  click[b1] (1 attempt): opened B1" in text


def test_anchor_ref_falls_back_to_the_expert_and_future_renders_as_in_step():
    me = episode(0, [turn("click[x]", "s1", diff="no change")])
    other = episode(1, [turn("click[y]", "s1", diff="no change")])
    group = [me, other]
    text, used, fired = hindsight_anchor(ctx(me, 0, group, expert=EXPERT), "ref,future", anchor_groups(group))
    assert text == ("[Hindsight: what attempts from this same state revealed]\n"
                    "What successful attempts did from this state:\n  click[b1] (expert)\n"
                    "What happened next (this attempt failed, reward 0.00):\n  turn 1: click[x] -> no change")
    assert used == ["ref", "future"] and fired == ["ref"]


def test_anchor_ref_keys_expert_steps_without_a_state_key_by_their_observation():
    # expert data recorded without state keys: each step is keyed by its observation's hash, as in step granularity
    from envs.base import state_key

    expert = [{"observation": s["observation"], "action": s["action"]} for s in EXPERT]
    me = episode(0, [turn("click[x]", state_key("page s1"), diff="no change")])
    other = episode(1, [turn("click[y]", state_key("page s1"), diff="no change")])
    group = [me, other]
    text, used, fired = hindsight_anchor(ctx(me, 0, group, expert=expert), "ref", anchor_groups(group))
    assert "click[b1] (expert)" in text and used == ["ref"] and fired == ["ref"]


def test_anchor_singleton_falls_back_to_step():
    group = [FAILED, LOST2]
    anchors = anchor_groups(group)
    for t in range(3):
        c = ctx(FAILED, t, group, expert=EXPERT)
        if sum(a == anchors[(0, t)] for a in anchors.values()) == 1:
            assert hindsight_anchor(c, "ref|error", anchors) == hindsight_step(c, "ref|error")
    assert hindsight_anchor(ctx(FAILED, 0, group, expert=EXPERT), "error,ref", anchors)[0].startswith(fb.STEP_HEADER)
