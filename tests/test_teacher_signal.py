"""The teacher signal (``serl_cli.method.teacher_signal``): its arithmetic on hand-made turns,
the expert's reply as the expert policy writes it, and end to end on Sokoban rollouts of a
tiny model -- in ``selection_report.json`` (checked against forward passes made here), in
``serl show`` and in the ablation report."""

from __future__ import annotations

import json
import math

import pytest
import torch
from support import rollout_config
from typer.testing import CliRunner

from serl_cli.ablate import cells as ab_cells
from serl_cli.ablate import grid as ab
from serl_cli.ablate import grid_record as ab_record
from serl_cli.ablate.report import write_report
from serl_cli.artifacts import io
from serl_cli.artifacts.records import make_annotation, make_episode, make_turn
from serl_cli.artifacts.schema import read_annotations, read_rollouts
from serl_cli.cli import show as _show_cmd  # noqa: F401  (registers `show`)
from serl_cli.cli.root import app
from serl_cli.method.action_mask import action_span_mask
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.method.teacher import block_ids, teacher_prompt_ids
from serl_cli.method.teacher_signal import SpanScoring, expert_reply_ids, measure, signal_turns, teacher_signal
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.annotate import run_annotate
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.scoring import score

SOKOBAN = EnvConfig(name="sokoban", split="train", max_turns=3)


# -- the arithmetic, on hand-made turns ---------------------------------------------------------


def _turn(action, expert):
    return make_turn(action=action, expert_action=expert)


def _record(turn, log_ratio):
    return make_annotation(
        turn=turn,
        action_mask=[1],
        teacher_logprobs=None if log_ratio is None else [log_ratio],
        log_ratio_mean=log_ratio,
    )


EPISODES = [
    make_episode(
        [
            _turn("up", "down"),
            _turn("Down ", "down"),
            _turn("left", "up"),
            _turn("right", "up"),
            _turn("up", None),
            _turn("up", "up"),
        ]
    )
]
RECORDS = [_record(0, -0.2), _record(1, 0.1), _record(2, 0.3), _record(3, 0.0), _record(4, 0.5), _record(5, None)]


def test_signal_worked_by_hand():
    # turn 4 has no expert action (a deadlocked room), turn 5 was not scored
    assert signal_turns(RECORDS, EPISODES) == [0, 1, 2, 3]
    ln = math.log
    expert_logprobs = {  # (with the block, without it): action-span tokens of the expert's reply
        0: ([ln(0.5), ln(0.8)], [ln(0.5), ln(0.4)]),  # p 0.4 vs 0.2
        1: ([ln(0.9)], [ln(0.6)]),
        2: ([ln(0.1)], [ln(0.3)]),
        3: ([ln(0.25)], [ln(0.25)]),
    }
    s = teacher_signal(RECORDS, EPISODES, expert_logprobs)
    # 0: off the expert, lowered: right. 1: "Down " is the expert's "down", raised: right.
    # 2: off, raised: wrong. 3: off, a tie: wrong.
    assert s["turns"] == 4 and s["right_direction"] == pytest.approx(0.5)
    assert s["off_expert_turns"] == 3 and s["off_expert_right_direction"] == pytest.approx(1 / 3)
    assert s["on_expert_turns"] == 1 and s["on_expert_right_direction"] == pytest.approx(1.0)
    assert s["expert_prob_gain"] == pytest.approx((0.2 + 0.3 - 0.2 + 0.0) / 4)
    assert s["expert_prob_with_block"] == pytest.approx((0.4 + 0.9 + 0.1 + 0.25) / 4)
    assert s["expert_prob_without_block"] == pytest.approx((0.2 + 0.6 + 0.3 + 0.25) / 4)
    json.dumps(s, allow_nan=False)


def test_no_scored_turn_with_an_expert_action_gives_none():
    assert teacher_signal(RECORDS, EPISODES, {}) is None
    # nothing to score: the teacher is never called
    assert measure([RECORDS[4], RECORDS[5]], EPISODES, {}, SpanScoring(None, None, 1.0, 16384)) is None


# -- end to end on Sokoban --------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    from serl_cli.models.loading import load_model

    model, tok = load_model(str(tiny_model_dir))
    return model.eval(), tok


@pytest.fixture(scope="module")
def sokoban_run(tiny_model_dir, tmp_path_factory):
    """Annotated Sokoban rollouts of the random tiny model; every turn scored (rewards are all 0)."""
    run = tmp_path_factory.mktemp("signal") / "run"
    run_rollout(rollout_config(tiny_model_dir, run, env=SOKOBAN, tasks=2, group_size=2, max_new_tokens=8))
    run_annotate(str(run), AnnotateConfig(sources="error", placement="all", skip_zero_advantage=False, threads=1))
    return run


@pytest.mark.parametrize("bare", [False, True])
def test_expert_reply_is_what_the_expert_policy_records(tiny_model_dir, model_and_tokenizer, tmp_path, bare):
    from serl_cli.rollout.prompts import PromptConfig

    out = tmp_path / "expert"
    run_rollout(
        rollout_config(
            tiny_model_dir,
            out,
            env=SOKOBAN,
            tasks=2,
            group_size=1,
            policy="expert",
            prompt=PromptConfig(bare_replies=bare),
        )
    )
    _, tok = model_and_tokenizer
    turns = [t for ep in read_rollouts(out) for t in ep.turns]
    assert turns and all(t.action_ids == expert_reply_ids(tok, t.action, bare) for t in turns)
    # the other form is another token sequence: scored in it, the expert's reply means nothing
    assert all(t.action_ids != expert_reply_ids(tok, t.action, not bare) for t in turns)


def forward_pass_signal(model, tok, episodes, records) -> tuple[list, dict, int]:
    """The turns with an expert action, the mean probability of the expert's reply with the block
    and without it, each from a forward pass of its own at temperature 1, and how many turns the
    teacher moves the right way."""
    turns = [(e, t) for e, ep in enumerate(episodes) for t, turn in enumerate(ep.turns) if turn.expert_action]
    by_turn = {(r.episode, r.turn): r for r in records}
    probs: dict[str, list[float]] = {"with": [], "without": []}
    right = 0
    for e, t in turns:
        turn, rec = episodes[e].turns[t], by_turn[e, t]
        reply = expert_reply_ids(tok, turn.expert_action)
        mask = torch.tensor(action_span_mask(tok, reply), dtype=torch.bool)
        with_block = teacher_prompt_ids(turn.prompt_ids, block_ids(tok, rec.hindsight), tok.eos_token_id)
        for side, prompt in (("with", with_block), ("without", turn.prompt_ids)):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1]
            lp = logits.log_softmax(-1).gather(1, torch.tensor(reply)[:, None])[:, 0]
            probs[side].append(lp[mask].sum().exp().item())
        on_expert = turn.action.strip().lower() == turn.expert_action
        right += rec.log_ratio_mean > 0 if on_expert else rec.log_ratio_mean < 0
    return turns, {k: sum(v) / len(v) for k, v in probs.items()}, right


def test_selection_report_has_the_signal_of_forward_passes(sokoban_run, model_and_tokenizer):
    report = io.read_json(sokoban_run / "selection_report.json")
    s = report["teacher"]["teacher_signal"]
    episodes, records = read_rollouts(sokoban_run), read_annotations(sokoban_run)
    model, tok = model_and_tokenizer
    turns, mean, right = forward_pass_signal(model, tok, episodes, records)
    assert s["turns"] == len(turns) > 0 and s["off_expert_turns"] + s["on_expert_turns"] == s["turns"]
    assert s["expert_prob_with_block"] == pytest.approx(mean["with"], rel=1e-4)
    assert s["expert_prob_without_block"] == pytest.approx(mean["without"], rel=1e-4)
    gain = mean["with"] - mean["without"]
    assert s["expert_prob_gain"] == pytest.approx(gain, abs=1e-4 * (mean["with"] + mean["without"]))
    assert s["right_direction"] == pytest.approx(right / len(turns))
    # the manifest's annotate stage carries the same statistics
    assert io.load_manifest(sokoban_run)["stages"]["annotate"]["stats"]["teacher_signal"] == s


def test_the_signal_takes_the_annotations_scores_of_the_items_it_scored(tiny_model_dir, model_and_tokenizer, tmp_path):
    """Where the student took the expert's action, the expert's reply with the block is the item
    the annotation scored: the signal takes those log-probs and scores only the rest (its price: docs/SCALING.md,
    "SERL's price"), and its figures are still those of forward passes made here."""
    run = tmp_path / "expert"
    run_rollout(rollout_config(tiny_model_dir, run, env=SOKOBAN, tasks=2, group_size=1, policy="expert"))
    episodes = read_rollouts(run)
    for turn in (t for ep in episodes for t in ep.turns):
        turn.behaviour_logprobs = [-1.0] * len(turn.action_ids)  # the expert policy records none
    model, tok = model_and_tokenizer
    calls: list[list[tuple]] = []

    def counting(model, tok, items, temperature, micro_batch_tokens):
        calls.append([(tuple(it.prompt_ids), tuple(it.action_ids)) for it in items])
        return score(model, tok, items, temperature, micro_batch_tokens)

    cfg = AnnotateConfig(sources="obs", placement="all", skip_zero_advantage=False)
    records, stats = annotate_episodes(episodes, cfg, model, tok, env_cfg=None, scorer=counting)
    s = stats["teacher_signal"]
    assert s["on_expert_turns"] == s["turns"] == stats["teacher_turns_scored"] > 0  # the expert's own rollouts
    annotation, signal = calls
    # every turn's expert reply with the block was the annotation's item: only the ones without are scored
    assert len(signal) == len(set(signal)) == s["turns"] and not set(signal) & set(annotation)
    assert all(len(prompt) < len(teacher) for (prompt, _), (teacher, _) in zip(signal, annotation, strict=True))
    turns, mean, right = forward_pass_signal(model, tok, episodes, records)
    assert len(turns) == s["turns"] and s["right_direction"] == pytest.approx(right / len(turns))
    assert s["expert_prob_with_block"] == pytest.approx(mean["with"], rel=1e-4)
    assert s["expert_prob_without_block"] == pytest.approx(mean["without"], rel=1e-4)


def test_setting_off_measures_nothing(sokoban_run, model_and_tokenizer):
    model, tok = model_and_tokenizer
    cfg = AnnotateConfig(sources="error", placement="all", skip_zero_advantage=False, teacher_signal=False)
    _, stats = annotate_episodes(read_rollouts(sokoban_run), cfg, model, tok, env_cfg=None)
    assert stats["teacher_turns_scored"] > 0 and "teacher_signal" not in stats


def test_show_prints_the_signal(sokoban_run):
    s = io.read_json(sokoban_run / "selection_report.json")["teacher"]["teacher_signal"]
    res = CliRunner().invoke(app, ["show", str(sokoban_run), "--width", "400"])
    assert res.exit_code == 0, res.output
    assert f"teacher signal, {s['turns']} scored turns with an expert action" in res.output
    assert f"right way on {s['right_direction']:.1%}" in res.output and f"{s['expert_prob_gain']:+.3g}" in res.output


def test_an_annotated_update_logs_the_signal_and_plot_draws_its_panel(sokoban_run, tmp_path):
    """The update carries the annotation's teacher signal into its metrics, where `serl plot`'s
    teacher-signal panel reads it (before: a promised panel that never appeared)."""
    import shutil

    from serl_cli.stages.train import train_on_run
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import TrainConfig
    from serl_cli.views.plot import drawn_panels

    run = tmp_path / "run"
    shutil.copytree(sokoban_run, run)
    s = io.read_json(run / "selection_report.json")["teacher"]["teacher_signal"]
    m = train_on_run(str(run), TrainConfig(algo="serl", optim=OptimConfig(lr=1e-3), threads=1))
    assert m["teacher_right_direction"] == s["right_direction"]
    assert m["teacher_expert_prob_gain"] == s["expert_prob_gain"]
    records = list(io.iter_jsonl(run / "metrics.jsonl"))
    panels = dict(drawn_panels(records, "iteration"))
    assert [key for key, _ in panels["teacher signal"]] == ["teacher_right_direction", "teacher_expert_prob_gain"]
    assert panels["teacher signal"][0][1] == ([1.0], [s["right_direction"]])  # single update: x is its count


# -- the ablation report ---------------------------------------------------------------------

SERL_ARM = "webshop-serl-error-step-all"  # serl's default placement


def test_ablation_report_averages_the_last_measured_iteration_over_seeds(tmp_path):
    grid = ab.load_grid(flags={"sources": "error", "seeds": 2})  # grpo, serl-error
    rec = ab_record.grid_record(grid, [])
    ab_record.write_grid(tmp_path, rec)
    signals = {0: (0.5, 0.02), 1: (0.7, -0.01)}  # seed -> (right_direction, expert_prob_gain), last measured
    for cell in rec["cells"]:
        d = ab_cells.cell_dir(tmp_path, cell)
        d.mkdir(parents=True)
        io.write_json(d / "eval.json", {"success_rate": 0.5, "score": 50.0, "episodes": 10})
        io.write_json(d / "cell.json", {"status": "done", "wall_time_s": 1.0, "teacher_tokens_scored": 10})
        if cell["arm"] != SERL_ARM:
            continue
        right, gain = signals[cell["seed"]]
        teacher = (
            {"teacher_signal": {"turns": 3, "right_direction": 0.0, "expert_prob_gain": 9.0}},  # earlier
            {"teacher_signal": {"turns": 4, "right_direction": right, "expert_prob_gain": gain}},
            {"teacher_skipped": True},
        )  # lambda decayed to 0: no teacher, no signal
        for k, stats in enumerate(teacher):
            it = d / "train" / f"iter_{k:04d}"
            it.mkdir(parents=True)
            io.write_json(it / "selection_report.json", {"teacher": stats})
    rows = {r["arm"]: r for r in write_report(tmp_path)["rows"]}
    serl, grpo = rows[SERL_ARM], rows["webshop-grpo"]
    assert serl["teacher_signal_seeds"] == 2 and serl["teacher_right_direction"] == pytest.approx(0.6)
    assert serl["teacher_expert_prob_gain"] == pytest.approx(0.005)
    assert grpo["teacher_signal_seeds"] == 0 and grpo["teacher_right_direction"] is None
    md = (tmp_path / "report.md").read_text()
    assert f"| {SERL_ARM} | 2 | 0.600 | +0.005 |" in md and "| webshop-grpo | 0 | n/a | n/a |" in md
    assert "teacher_right_direction" in (tmp_path / "report.csv").read_text()


def test_bare_replies_score_the_bare_expert_reply_on_its_action_span(tiny_model_dir, model_and_tokenizer, tmp_path):
    """With prompt.bare_replies the expert's reply is the bare move, scored on its action span as
    Sokoban's action format finds it: the signal's probability is that of those tokens (before
    the fix it was the tagged reply's, or 1 over an empty span)."""
    from serl_cli.method.annotation import action_format
    from serl_cli.rollout.prompts import PromptConfig

    run = tmp_path / "bare"
    run_rollout(
        rollout_config(
            tiny_model_dir,
            run,
            env=SOKOBAN,
            tasks=2,
            group_size=2,
            max_new_tokens=4,
            prompt=PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True),
        )
    )
    run_annotate(str(run), AnnotateConfig(sources="error,diff", placement="all", skip_zero_advantage=False, threads=1))
    s = io.read_json(run / "selection_report.json")["teacher"]["teacher_signal"]
    model, tok = model_and_tokenizer
    fmt = action_format(SOKOBAN.__dict__)
    probs = []
    for turn in (t for ep in read_rollouts(run) for t in ep.turns if t.expert_action):
        reply = expert_reply_ids(tok, turn.expert_action, bare_replies=True)
        assert tok.decode(reply, skip_special_tokens=True) == turn.expert_action
        mask = torch.tensor(action_span_mask(tok, reply, "none", fmt), dtype=torch.bool)
        assert mask.any() and not mask[-1]  # the move's tokens, not the end-of-turn token
        with torch.no_grad():
            logits = model(torch.tensor([turn.prompt_ids + reply])).logits[0, len(turn.prompt_ids) - 1 : -1]
        probs.append(logits.log_softmax(-1).gather(1, torch.tensor(reply)[:, None])[:, 0][mask].sum().exp().item())
    assert s["turns"] == len(probs) > 0
    assert s["expert_prob_without_block"] == pytest.approx(sum(probs) / len(probs), rel=1e-4)
    assert s["expert_prob_without_block"] < 1
