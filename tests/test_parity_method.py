"""Parity with the authors' code on the method side (github.com/OliverLeeXZ/SERL, commit 5a2a85b):
the teacher prompt, the `future` source, and what `serl annotate` reweights by default.

The expected values are written here by hand from the authors' template strings and their
description (docs/PARITY.md), not taken from serl's constants and not copied from their code:

* PC = recipe/serl/privileged_context.py, YAML = recipe/serl/config/serl_trainer.yaml,
  SRT = recipe/serl/serl_ray_trainer.py.
* The default teacher prompt (sampling_mode ``immediate_feedback``, YAML:47) is the student's
  user message, then ``"\\n\\n"``, the section ``"Immediate feedback from the current step:\\n"``
  + the stripped raw answer, then ``"\\n\\nCorrectly solve the current task.\\n"`` (YAML:65,
  PC:1634-1637, PC:1679-1682), rendered with the student's chat template.
* ``future_trajectory`` holds the turns after the current one only, and no outcome (PC:407-426).
* Every turn with a block is reweighted (``used_context``, PC:1843-1845), on the parsed action's
  tokens only; a reply with no parseable action keeps all its weights at 1 (SRT:104-152, 592-596).
"""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest
from support import rollout_config

from serl_cli.artifacts import io
from serl_cli.artifacts.records import Episode, make_episode, make_turn
from serl_cli.artifacts.schema import read_annotations, read_manifest, read_rollouts
from serl_cli.method import feedback as fb
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.models.loading import load_model
from serl_cli.rollout.prompts import PromptConfig, build_messages, render_prompt_ids
from serl_cli.stages.annotate import run_annotate
from serl_cli.stages.rollout import run_rollout

THINK_AND_ACT = "<think>the red one</think><action>click[b01]</action>"
UNPARSED = "hello there"


@pytest.fixture(scope="module")
def tokenizer(stopping_model_dir):
    return load_model(str(stopping_model_dir))[1]


@pytest.fixture(scope="module")
def run_dir(stopping_model_dir, tmp_path_factory):
    """Tiny-model rollouts (1 task x 4) whose replies are rewritten (rewards and replies are data
    here): even turns think then act, odd turns write no action; rollouts 0 and 2 succeed; the
    second turn of every rollout got an empty answer from the environment (so it has no block)."""
    run = tmp_path_factory.mktemp("parity") / "run"
    run_rollout(rollout_config(stopping_model_dir, run, tasks=1, group_size=4, max_new_tokens=6))
    _, tok = load_model(str(stopping_model_dir))
    episodes = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    for ep in episodes:
        ep["success"] = ep["rollout_index"] % 2 == 0
        ep["reward"] = float(ep["success"])
        for t, turn in enumerate(ep["turns"]):
            text = THINK_AND_ACT if t % 2 == 0 else UNPARSED
            turn["action_text"] = text
            turn["action_ids"] = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            turn["behaviour_logprobs"] = [-2.0] * len(turn["action_ids"])
            if t == 1:
                turn["next_observation"] = "  "
    assert all(len(ep["turns"]) >= 3 for ep in episodes)
    io.write_jsonl(run / "rollouts.jsonl", episodes)
    return run


def spy_scorer(seen: list):
    """A teacher that records what it is asked and answers -1 per token."""

    def scorer(model, tokenizer, items, temperature, micro_batch_tokens):
        seen.extend(items)
        return [[-1.0] * len(it.action_ids) for it in items]

    return scorer


# ---------------------------------------------------------------- the teacher prompt


def test_teacher_prompt_is_the_authors_template_filled_by_hand(tokenizer):
    user = (
        "Task: i need a red mug\nTurn 1. Current observation: WebShop [SEP] Search\nAdmissible actions: search[<query>]"
    )
    messages = build_messages(
        "You shop.", "i need a red mug", [], "WebShop [SEP] Search", ["search[<query>]"], PromptConfig()
    )
    assert messages[-1]["content"] == user
    action_ids = tokenizer.encode(THINK_AND_ACT, add_special_tokens=False) + [tokenizer.eos_token_id]
    turn = make_turn(
        observation="WebShop [SEP] Search",
        state_key="s0",
        prompt_ids=render_prompt_ids(tokenizer, messages),
        action_text=THINK_AND_ACT,
        action="click[b01]",
        action_ids=action_ids,
        behaviour_logprobs=[-2.0] * len(action_ids),
        next_observation="  Instruction: [SEP] i need a red mug [SEP] Back to Search\n",
    )
    group = [make_episode([replace(turn)], rollout_index=i, success=i == 0, reward=float(i == 0)) for i in range(2)]
    seen: list = []
    records, _ = annotate_episodes(
        group, AnnotateConfig(teacher_signal=False), None, tokenizer, env_cfg=None, scorer=spy_scorer(seen)
    )
    assert len(seen) == 2 and records[0].sources == ["obs"]
    # the authors' template (YAML:65) and section (PC:1634-1637), filled by hand
    teacher_user = (
        user
        + "\n\n"
        + "Immediate feedback from the current step:\n"
        + "Instruction: [SEP] i need a red mug [SEP] Back to Search"
        + "\n\nCorrectly solve the current task.\n"
    )
    expected = tokenizer.apply_chat_template(
        [messages[0], {"role": "user", "content": teacher_user}], tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.decode(seen[0].prompt_ids) == expected
    # spliced, not re-rendered: the student's own tokens are all there, in order, around the block
    student = turn.prompt_ids
    cut = len(student) - 1 - student[::-1].index(tokenizer.eos_token_id)
    assert seen[0].prompt_ids[:cut] == student[:cut] and seen[0].prompt_ids[-(len(student) - cut) :] == student[cut:]
    assert seen[0].action_ids == turn.action_ids  # the student's own reply is scored (SRT:568)


def test_the_block_cap_is_on_the_whole_block_and_keeps_the_closing_instruction(tokenizer, run_dir):
    episodes = read_rollouts(run_dir)
    seen: list = []
    records, _ = annotate_episodes(
        episodes,
        AnnotateConfig(sources="obs,future", max_hindsight_tokens=12, teacher_signal=False),
        None,
        tokenizer,
        env_cfg=None,
        scorer=spy_scorer(seen),
    )
    blocks = [r.hindsight for r in records if r.hindsight]
    assert blocks and all(len(tokenizer.encode(b, add_special_tokens=False)) <= 12 for b in blocks)
    assert any(b.endswith(" ...") for b in blocks)
    assert all(
        tokenizer.decode(it.prompt_ids).endswith(
            "Correctly solve the current task.\n<|im_end|>\n<|im_start|>assistant\n"
        )
        for it in seen
    )


# ---------------------------------------------------------------- future


def _episode(actions: list[str], success: bool) -> Episode:
    turns = [
        make_turn(
            action=a,
            action_text=f"<think>why {a}</think><action>{a}</action>",
            state_key=f"s{k}",
            observation=f"o{k}",
            next_observation=f"o{k + 1}",
        )
        for k, a in enumerate(actions)
    ]
    return make_episode(turns, success=success, reward=float(success))


@pytest.mark.parametrize("seed", range(20))
def test_future_never_contains_turn_ts_action_nor_the_outcome(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    actions = [f"click[item {rng.randint(0, 10**6)}-{k}]" for k in range(n)]  # distinct per turn
    ep = _episode(actions, success=rng.random() < 0.5)
    for t in range(n):
        text = fb.SOURCES["future"].render(fb.TurnContext(episode=ep, turn=t))
        if t == n - 1:
            assert text is None  # the last turn has no future: no block (PC:407-426)
            continue
        assert actions[t] not in text and all(a not in text for a in actions[:t])
        assert all(a in text for a in actions[t + 1 :])
        assert f"Step {t + 1}\n" not in text and "why" not in text  # nor its step, nor reasoning
        assert not any(w in text.lower() for w in ("succeeded", "failed", "reward", "outcome", "success"))


# ---------------------------------------------------------------- what `serl annotate` reweights by default


def test_serl_annotate_defaults_reweight_exactly_the_turns_with_a_block_on_their_action_tokens(
    run_dir, tmp_path, tokenizer
):
    from rich.console import Console

    from serl_cli.views import show

    run = tmp_path / "r"
    run.mkdir()
    for f in ("manifest.json", "rollouts.jsonl"):
        (run / f).write_bytes((run_dir / f).read_bytes())
    defaults = AnnotateConfig(threads=1)
    assert (defaults.sources, defaults.placement, defaults.tokens, defaults.unparsed) == (
        "obs",
        "all",
        "action",
        "none",
    )
    run_annotate(str(run), defaults)
    records, episodes = read_annotations(run), read_rollouts(run)
    reweighted = 0
    for r in records:
        turn = episodes[r.episode].turns[r.turn]
        has_block = bool(turn.next_observation.strip())
        assert r.selected == has_block == (r.hindsight is not None)
        assert r.hindsight is None or r.hindsight.startswith("Immediate feedback from the current step:\n")
        parsed = turn.action_text == THINK_AND_ACT
        inside = tokenizer.decode([i for i, m in zip(turn.action_ids, r.action_mask, strict=True) if m])
        assert ("click[b01]" in inside and "think" not in inside and "red" not in inside) if parsed else inside == ""
        if not (has_block and parsed and r.advantage != 0):
            assert r.weights is None or all(w == 1.0 for w in r.weights)
            continue
        assert r.weights is not None
        for w, m in zip(r.weights, r.action_mask, strict=True):
            assert (w != 1.0) if m else (w == 1.0)  # teacher -1 vs student -2: every action token moves
        reweighted += 1
    assert reweighted >= 2
    # and `serl show` displays it: the action tokens shaded, the rest dim, the scope named
    manifest = read_manifest(run)
    ann = {(r.episode, r.turn): r for r in records}
    console = Console(record=True, width=200)
    console.print(show.episode_view(manifest, episodes, ann, 0))
    text = console.export_text()
    assert "reweighted: the parsed action's tokens only" in text and "all 1" in text


def test_rlsd_annotations_weight_every_reply_token_of_every_turn_with_a_block(run_dir, tokenizer):
    episodes = read_rollouts(run_dir)
    records, _ = annotate_episodes(
        episodes,
        AnnotateConfig(tokens="reply", teacher_signal=False),
        None,
        tokenizer,
        env_cfg=None,
        scorer=spy_scorer([]),
    )
    for r in records:
        scored = r.hindsight is not None and r.advantage != 0
        assert (r.weights is not None) == scored  # unparsed replies included: rlsd is not selective
        if scored:
            assert all(w != 1.0 for w in r.weights)


def test_weights_are_the_authors_formula_on_action_tokens(run_dir, tokenizer):
    """w = clip(exp(sign(A) (log pi_T - log pi_old)), 1 - c, 1 + c), blended (1 - lambda) + lambda w
    (CA:465-487), by hand: teacher -1 vs student -2 per token gives exp(+-1), clipped to 1 +- 0.2."""
    episodes = read_rollouts(run_dir)
    records, _ = annotate_episodes(
        episodes, AnnotateConfig(teacher_signal=False), None, tokenizer, env_cfg=None, scorer=spy_scorer([])
    )
    lam, c = 0.5, 0.2
    checked = 0
    for r in records:
        if r.weights is None:
            continue
        checked += 1
        expect = (1 - lam) + lam * ((1 + c) if r.advantage > 0 else (1 - c))
        assert [w for w, m in zip(r.weights, r.action_mask, strict=True) if m] == pytest.approx(
            [expect] * sum(r.action_mask), abs=1e-12
        )
    assert checked >= 2 and {r.advantage > 0 for r in records if r.weights} == {True, False}
