"""The annotate stage on real tiny-model rollouts, and the algorithms that consume it.

Rewards of a random-init model are all 0, so each test gives half of every group reward 1
(success) in the stored records -- rewards are data here -- to make advantages nonzero.
"""

from __future__ import annotations

import json

import pytest
import torch
from reliability.faults import tree_hash
from support import assert_one_line_error, make_half_successful, rollout_config, serl

from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_annotations, read_rollouts
from serl_cli.errors import SerlError
from serl_cli.method.action_mask import action_span_mask
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.method.teacher import teacher_prompt_ids
from serl_cli.stages.annotate import run_annotate
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.learner import Learner
from serl_cli.training.step import OptimConfig
from serl_cli.training.train_config import TrainConfig


@pytest.fixture(scope="module")
def run_dir(stopping_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("annot") / "run"
    run_rollout(rollout_config(stopping_model_dir, run, tasks=2, group_size=4, max_new_tokens=12))
    make_half_successful(run)
    return run


@pytest.fixture(scope="module")
def model_and_tokenizer(stopping_model_dir):
    from serl_cli.models.loading import load_model

    model, tok = load_model(str(stopping_model_dir))
    return model.eval(), tok


def annotate(run_dir, model_and_tokenizer, **kw):
    model, tok = model_and_tokenizer
    episodes = read_rollouts(run_dir)
    cfg = AnnotateConfig(**{"sources": "error", **kw})
    return episodes, *annotate_episodes(episodes, cfg, model, tok, env_cfg=None)


def test_teacher_prompt_splices_block_before_end_of_turn():
    # prompt: ... user text <eot> \n <assistant header>; the block goes before that <eot>
    assert teacher_prompt_ids([1, 5, 6, 2, 9, 1, 7], [40, 41], end_of_turn_id=2) == [1, 5, 6, 40, 41, 2, 9, 1, 7]
    with pytest.raises(SerlError, match="end-of-turn"):
        teacher_prompt_ids([1, 5, 6], [40], end_of_turn_id=2)


def test_action_mask_excludes_reasoning_tags_and_end(model_and_tokenizer):
    _, tok = model_and_tokenizer
    ids = tok.encode("<think>look first</think><action>click[buy now]</action>", add_special_tokens=False) + [
        tok.eos_token_id
    ]
    mask = action_span_mask(tok, ids)
    inside = tok.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert "click[buy now]" in inside and "think" not in inside and "look" not in inside
    assert mask[-1] == 0  # the end-of-turn token keeps weight 1
    bare = tok.encode("search[red shoes]", add_special_tokens=False)
    assert all(action_span_mask(tok, bare))
    # no parseable action: no weights, as the authors' serl_action_mask (SRT:592-596) ...
    hello = tok.encode("hello there", add_special_tokens=False) + [tok.eos_token_id]
    assert not any(action_span_mask(tok, hello))
    # ... or, with unparsed=whole, all of it, since the environment got the whole reply (the end token keeps 1)
    assert action_span_mask(tok, hello, "whole") == [1] * (len(hello) - 1) + [0]
    with pytest.raises(SerlError, match="unparsed"):
        action_span_mask(tok, hello, "some")


def test_action_mask_reads_the_environments_bare_format(model_and_tokenizer):
    from envs.sokoban.env import ACTION_FORMAT

    _, tok = model_and_tokenizer
    ids = tok.encode("up", add_special_tokens=False)
    assert not any(action_span_mask(tok, ids))  # not a WebShop action
    assert all(action_span_mask(tok, ids, "none", ACTION_FORMAT))  # a Sokoban one


def test_feedback_placement_selects_fired_turns_and_scores_only_those(run_dir, model_and_tokenizer):
    episodes, records, stats = annotate(run_dir, model_and_tokenizer, placement="feedback", unparsed="whole")
    assert len(records) == sum(len(e.turns) for e in episodes)
    for r in records:
        assert r.selected == bool(r.fired)
        scored = r.teacher_logprobs is not None
        assert scored == (r.selected and r.advantage != 0)  # A = 0 keeps weight 1: not scored
        if r.weights is not None:
            assert len(r.weights) == len(r.teacher_logprobs) == len(r.action_mask)
            for w, m in zip(r.weights, r.action_mask, strict=True):
                assert (0.9 - 1e-9 <= w <= 1.1 + 1e-9) if m else w == 1.0  # lambda 0.5, c 0.2
    assert stats["teacher_turns_scored"] == sum(r.teacher_logprobs is not None for r in records)


@pytest.mark.parametrize("sources", ["diff", "ref|error"])
def test_random_matches_feedback_on_scored_turns_and_all_scores_more(run_dir, model_and_tokenizer, sources):
    # under ref|error a selected turn may have no block (or A = 0): the budget is the turns the teacher scores.
    # What is counted here does not need the teacher-signal diagnostic (two more passes per scored turn).
    kw = dict(sources=sources, unparsed="whole", teacher_signal=False)
    _, fb_records, fb_stats = annotate(run_dir, model_and_tokenizer, placement="feedback", **kw)
    _, all_records, all_stats = annotate(run_dir, model_and_tokenizer, placement="all", **kw)
    assert fb_stats["teacher_turns_scored"] > 0
    for seed in range(4):
        _, rnd_records, rnd_stats = annotate(run_dir, model_and_tokenizer, placement="random", seed=seed, **kw)
        assert rnd_stats["teacher_turns_scored"] == fb_stats["teacher_turns_scored"]
        assert sum(r.weights is not None for r in rnd_records) == sum(r.weights is not None for r in fb_records)
    assert [r.selected for r in all_records] == [r.hindsight is not None for r in all_records]
    assert all_stats["teacher_turns_scored"] >= fb_stats["teacher_turns_scored"]


def test_lambda_zero_skips_the_teacher(run_dir, model_and_tokenizer):
    model, tok = model_and_tokenizer
    calls = []

    def spy(*args):
        calls.append(args)
        raise AssertionError("the teacher ran at lambda = 0")

    episodes = read_rollouts(run_dir)
    for kw in ({"mixing_lambda": 0.0}, {"update_step": 50}, {"update_step": 80}):  # decayed to 0 after 50 updates
        records, stats = annotate_episodes(
            episodes, AnnotateConfig(sources="obs", teacher_signal=False, **kw), model, tok, env_cfg=None, scorer=spy
        )
        assert not calls and stats["teacher_skipped"] and stats["teacher_turns_scored"] == 0 and stats["lambda"] == 0
        assert all(r.weights is None and r.teacher_logprobs is None for r in records)
    # distillation wants the teacher's log-probs for themselves: lambda = 0 does not skip it then
    _, stats = annotate_episodes(
        episodes,
        AnnotateConfig(sources="obs", mixing_lambda=0.0, skip_zero_advantage=False, teacher_signal=False),
        model,
        tok,
        env_cfg=None,
    )
    assert not stats["teacher_skipped"] and stats["teacher_turns_scored"] > 0


def test_rlsd_weights_every_reply_token(run_dir, model_and_tokenizer):
    _, records, _ = annotate(
        run_dir, model_and_tokenizer, sources="obs", tokens="reply", mixing_lambda=1.0, unparsed="whole"
    )
    off_action = [w for r in records if r.weights for w, m in zip(r.weights, r.action_mask, strict=True) if not m]
    assert off_action and any(w != 1.0 for w in off_action)  # reasoning, tags and the end token are reweighted too
    _, serl_records, _ = annotate(run_dir, model_and_tokenizer, sources="obs", mixing_lambda=1.0, unparsed="whole")
    assert all(
        w == 1.0 for r in serl_records if r.weights for w, m in zip(r.weights, r.action_mask, strict=True) if not m
    )
    with pytest.raises(SerlError, match="tokens"):
        annotate(run_dir, model_and_tokenizer, tokens="reasoning")


def test_weights_follow_the_formula(run_dir, model_and_tokenizer):
    from serl_cli.algos.serl import blend_weights, hindsight_weights

    episodes, records, _ = annotate(
        run_dir, model_and_tokenizer, placement="all", weight_clip=0.2, mixing_lambda=0.5, unparsed="whole"
    )
    turns = [t for e in episodes for t in e.turns]
    checked = 0
    for r, t in zip(records, turns, strict=True):
        if r.weights is None:
            continue
        lp_t = torch.tensor(r.teacher_logprobs, dtype=torch.float64)
        lp_o = torch.tensor(t.behaviour_logprobs, dtype=torch.float64)
        expect = blend_weights(hindsight_weights(lp_t, lp_o, torch.tensor(r.advantage), 0.2), 0.5)
        for w, e, m in zip(r.weights, expect.tolist(), r.action_mask, strict=True):
            assert w == pytest.approx(e if m else 1.0, abs=1e-12)
        checked += 1
    assert checked > 0


def _grads(model_dir, episodes, algo, annotations=None, meta=None):
    cfg = TrainConfig(algo=algo, optim=OptimConfig(lr=0.0, micro_batch_tokens=4096), threads=1)
    learner = Learner(str(model_dir), cfg)
    learner.optimizer.step = lambda *a, **k: None  # keep weights; read the accumulated gradient
    metrics = learner.update(episodes, 1.0, annotations, meta)
    return metrics, {n: p.grad.clone() for n, p in learner.model.named_parameters() if p.grad is not None}


def test_serl_at_lambda_zero_is_grpo(run_dir, model_and_tokenizer, stopping_model_dir):
    episodes, records, stats = annotate(run_dir, model_and_tokenizer, placement="all", mixing_lambda=0.0)
    assert all(w == 1.0 for r in records if r.weights for w in r.weights)
    meta = {"config": {"placement": "all", "weight_clip": 0.2}, "stats": stats}
    m_serl, g_serl = _grads(stopping_model_dir, episodes, "serl", records, meta)
    m_grpo, g_grpo = _grads(stopping_model_dir, episodes, "grpo")
    assert m_serl["loss"] == m_grpo["loss"] and m_grpo["loss"] != 0.0
    assert g_serl.keys() == g_grpo.keys() and all(torch.equal(g_serl[k], g_grpo[k]) for k in g_grpo)


def test_serl_with_weights_differs_from_grpo(run_dir, model_and_tokenizer, stopping_model_dir):
    episodes, records, stats = annotate(
        run_dir, model_and_tokenizer, placement="all", mixing_lambda=1.0, unparsed="whole"
    )
    meta = {"config": {"placement": "all", "weight_clip": 0.2}, "stats": stats}
    m_serl, _ = _grads(stopping_model_dir, episodes, "serl", records, meta)
    m_grpo, _ = _grads(stopping_model_dir, episodes, "grpo")
    assert m_serl["loss"] != m_grpo["loss"]
    assert m_serl["selected_fraction"] == 1.0 and m_serl["lambda"] == 1.0
    assert 0.8 - 1e-9 <= m_serl["weight_min"] <= m_serl["weight_max"] <= 1.2 + 1e-9


def test_run_annotate_writes_and_train_checks_provenance(run_dir, tmp_path, stopping_model_dir):
    run = tmp_path / "r"
    run.mkdir()
    for f in ("manifest.json", "rollouts.jsonl"):
        (run / f).write_bytes((run_dir / f).read_bytes())
    summary = run_annotate(str(run), AnnotateConfig(sources="error,diff", placement="feedback", threads=1))
    assert (run / "annotations.jsonl").is_file() and (run / "selection_report.json").is_file()
    report = json.loads((run / "selection_report.json").read_text())
    assert report["counts"]["turns"] == summary["turns"] and "verdict" in report["tests"]
    assert len(read_annotations(run)) == summary["turns"]
    # rollouts replaced after annotating: the annotations belong to another run
    episodes = [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]
    episodes[0]["reward"] = 0.5
    io.write_jsonl(run / "rollouts.jsonl", episodes)
    before = tree_hash(run)
    assert_one_line_error(serl("train", str(run), "--algo", "serl"), "made from other rollouts")
    assert tree_hash(run) == before


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--sources", "ref|"], "empty"),
        (["--sources", "smell"], "unknown"),
        (["--placement", "everywhere"], "unknown placement"),
        (["--granularity", "paragraph"], "'paragraph' is not one of"),
    ],
)
def test_annotate_bad_input(run_dir, tmp_path, args, needle):
    run = tmp_path / "r"
    run.mkdir()
    for f in ("manifest.json", "rollouts.jsonl"):
        (run / f).write_bytes((run_dir / f).read_bytes())
    before = tree_hash(run)
    assert_one_line_error(serl("annotate", str(run), *args), needle)
    assert tree_hash(run) == before


def test_serl_without_annotations_is_refused(run_dir, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    for f in ("manifest.json", "rollouts.jsonl"):
        (run / f).write_bytes((run_dir / f).read_bytes())
    assert_one_line_error(serl("train", str(run), "--algo", "serl"), "has no annotations")
    assert not (run / "checkpoint").exists()


def test_run_annotate_reports_teacher_progress(run_dir, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    for f in ("manifest.json", "rollouts.jsonl"):
        (run / f).write_bytes((run_dir / f).read_bytes())
    calls = []
    summary = run_annotate(
        str(run),
        AnnotateConfig(sources="obs", unparsed="whole", threads=1, teacher_signal=False),
        progress=lambda done, total: calls.append((done, total)),
    )
    assert calls and calls[-1] == (summary["teacher_turns_scored"],) * 2  # the bar ends full
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_a_journal_unit_short_of_log_probs_is_refused(tmp_path):
    """A resumed annotation reuses the journal's units; one whose log-probs do not cover its
    items (a hand-edited or foreign journal) is refused, not paired up short (a turn left empty)."""
    from types import SimpleNamespace

    from serl_cli.stages.annotate import journaled_scorer
    from serl_cli.training.scoring import ScoreItem, score_units

    tok = SimpleNamespace(pad_token_id=0, eos_token_id=0)
    items = [ScoreItem([1, 2], [3]), ScoreItem([1, 2, 5], [4, 6])]
    (index,) = score_units(tok, items, 16384)
    logprobs = [[-0.5] * len(items[i].action_ids) for i in index]
    # a whole unit is reused as it is: no model is asked (None would fail)
    whole = journaled_scorer(tmp_path / "a.jsonl", [{"unit": 0, "items": index, "logprobs": logprobs}])
    assert whole(None, tok, items, 1.0, 16384) == [logprobs[index.index(i)] for i in range(len(items))]
    short = journaled_scorer(tmp_path / "b.jsonl", [{"unit": 0, "items": index, "logprobs": logprobs[:1]}])
    with pytest.raises(SerlError, match="teacher batch 0"):
        short(None, tok, items, 1.0, 16384)
