"""The benchmark suite's bookkeeping: FLOP counts, TRL's batch layout, micro-batch sizing,
targets, the JSON it writes. No timing is asserted anywhere: speed goals live in the
benchmarks' own output."""

from __future__ import annotations

import json

import pytest
import torch
from support import synthetic_env

from benchmarks.common import Figure, figure_rows, target_met, write_json
from benchmarks.flops import matmul_flops, non_embedding_parameters, step_flops
from benchmarks.suite import external_figures, main
from benchmarks.trl_grpo import rows_per_micro_batch, serl_padded_tokens, trl_inputs
from serl_cli.artifacts.schema import TurnSample


def sample(prompt, action, logps=None, episode=0):
    return TurnSample(
        episode=episode,
        turn=0,
        group_key=(0, 0),
        prompt_ids=prompt,
        action_ids=action,
        behaviour_logprobs=logps or [0.0] * len(action),
        episode_reward=0.0,
        success=False,
        state_key="s",
        turn_reward=0.0,
    )


def test_targets_are_read_from_their_text():
    assert target_met(0.7, "<= 0.8") is True
    assert target_met(0.81, "<= 0.8") is False
    assert target_met(0.3, ">= 0.3") is True
    assert target_met(0.29, ">=0.3") is False
    assert target_met(None, "<= 0.8") is None  # a skipped figure meets nothing
    assert target_met(5.0, "") is None
    rows = figure_rows([Figure("trl", "serl / TRL", 0.5, "x", "<= 0.8"), Figure("trl", "TRL step", None)])
    assert rows[0][5] == "yes" and rows[1][2] == "-" and rows[1][5] == ""


def test_step_flops_by_hand():
    # two rows: 3 prompt + 2 action tokens (T = 5) and 1 + 1 (T = 2); N = 10, 2 layers, d 4, vocab 7
    samples = [sample([1, 2, 3], [4, 5]), sample([1], [2])]
    f = step_flops(samples, n_params=10, layers=2, d_model=4, vocab=7)
    assert f["tokens"] == 7 and f["action_tokens"] == 3
    assert f["six_n"] == 6 * 10 * 7  # 420
    assert f["attention"] == 12 * 2 * 4 * (5 * 5 + 2 * 2)  # 2784: per token 12 L d T, T tokens per row
    assert f["lm_head"] == 6 * 7 * 4 * 3  # 504
    assert matmul_flops(1000, 2.0) == 1e9  # 2 x 1000^3 FLOPs in 2 s


def test_non_embedding_parameters_leave_out_the_tied_embedding(tiny_model_dir):
    from serl_cli.models.loading import load_model

    model, _ = load_model(str(tiny_model_dir))
    assert model.config.tie_word_embeddings
    layers = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    assert non_embedding_parameters(model) == layers


def test_trl_batch_layout_by_hand():
    samples = [sample([5, 6, 7], [8, 9], [-1.0, -2.0]), sample([4], [3], [-0.5])]
    b = trl_inputs(samples, torch.tensor([1.0, -1.0]), pad_id=0)
    assert b["prompt_ids"].tolist() == [[5, 6, 7], [0, 0, 4]]  # prompts left-padded
    assert b["prompt_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert b["completion_ids"].tolist() == [[8, 9], [3, 0]]  # completions right-padded
    assert b["completion_mask"].tolist() == [[1, 1], [1, 0]]
    assert b["old_per_token_logps"].tolist() == [[-1.0, -2.0], [-0.5, 0.0]]
    assert b["advantages"].tolist() == [1.0, -1.0]
    assert float(b["num_items_in_batch"]) == 3.0


def test_micro_batch_sizes():
    # TRL: equal micro-batches, so the row count must divide the batch; rows x width within the budget
    assert rows_per_micro_batch(96, 615, 16384) == 24  # 26 would fit, 24 is the largest divisor <= 26
    assert rows_per_micro_batch(12, 10, 1000) == 12
    assert rows_per_micro_batch(7, 100, 300) == 1  # 7 is prime
    # serl: length-sorted packing under the same budget (T = 2 and 5)
    samples = [sample([1, 2, 3], [4, 5]), sample([1], [2])]
    assert serl_padded_tokens(samples, 8, pad_id=0) == (2 + 5, 2)  # 2 x 5 = 10 > 8: two forwards
    assert serl_padded_tokens(samples, 10, pad_id=0) == (10, 1)


def test_external_sections_keep_their_headline_numbers():
    data = {
        "benchmark": "x",
        "episodes": 3,
        "flag": True,
        "latency": {"reset": {"p50_ms": 1.5, "n": 4}},
        "expert_episodes_per_s": 2.0,
    }
    figs = {f.name: f.value for f in external_figures("env_x", data)}
    assert figs == {"latency.reset.p50_ms": 1.5, "expert_episodes_per_s": 2.0}
    assert external_figures("env_x", {"a": "b"})[0].value is None


def test_json_is_written_whole(tmp_path):
    path = write_json(tmp_path / "r" / "suite.json", {"figures": [1, 2]})
    assert json.loads(path.read_text()) == {"figures": [1, 2]}
    assert [p.name for p in path.parent.iterdir()] == ["suite.json"]  # no temp file left


def test_suite_bad_input_exits_2(capsys):
    assert main(["--only", "nonsense"]) == 2
    assert "unknown section 'nonsense'" in capsys.readouterr().err
    assert main(["--threads", "0"]) == 2


def test_suite_quick_section_writes_table_and_json(tmp_path, capsys):
    out = tmp_path / "suite.json"
    assert main(["--quick", "--only", "env_webshop", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["sections"]["env_webshop"]["status"] == "ok"
    assert data["sections"]["env_webshop"]["episodes"] == 20
    figs = [f for f in data["figures"] if f["section"] == "env_webshop"]
    assert figs and all(f["value"] > 0 for f in figs)
    assert "serl benchmark suite (quick)" in capsys.readouterr().out


def test_trl_and_serl_take_the_same_first_gradient(tiny_model_dir, tmp_path):
    """Same weights, same batch, same loss: TRL's GRPOTrainer and serl's Learner must agree on
    the first step's gradient norm -- the comparison times the same update on both sides."""
    pytest.importorskip("trl")
    from benchmarks.train_step import UpdateBench, make_batch
    from benchmarks.trl_grpo import PeerBench, measure

    env = synthetic_env(max_turns=2)
    batch = make_batch(
        UpdateBench(
            catalog=env.settings["catalog"],
            model=str(tiny_model_dir),
            tasks=1,
            group_size=2,
            max_turns=2,
            max_new_tokens=4,
            threads=1,
        )
    )
    data = measure(PeerBench(repeats=1, threads=1), batch, log=lambda _: None)
    assert data["rows"] == batch.turns
    assert data["serl"]["turns_with_gradient"] == data["rows"]
    assert data["first_grad_norm_rel_diff"] < 1e-4
    assert data["trl"]["activation_checkpointing"] is False
    assert data["trl"]["padded_tokens"] >= data["real_tokens"] and data["serl"]["padded_tokens"] >= data["real_tokens"]


@pytest.mark.slow
def test_demo_range_runs_each_demo_and_reports_its_gains(tmp_path, capsys):
    """``benchmarks.demo_range`` on ``serl demo --quick``: one run per seed and thread count, each
    gain taken from that run's own demo.json."""
    from benchmarks.demo_range import main as demo_range
    from envs.sokoban.env import SokobanWorld
    from serl_cli.models.tiny import init_model
    from serl_cli.rollout.default_model import tokenizer_corpus

    micro = init_model("micro", tmp_path / "micro", tokenizer_corpus(SokobanWorld(), episodes=50))
    out = tmp_path / "results.json"
    argv = ["--quick", "--seeds", "0", "--threads", "1", "--out", str(tmp_path / "runs"), "--json", str(out)]
    assert demo_range([*argv, "--set", f"model={micro}"]) == 0
    data = json.loads(out.read_text())
    [run] = data["runs"]
    demo = json.loads((tmp_path / "runs" / "seed0-threads1" / "demo.json").read_text())
    warm = demo["results"]["warm start"]["success_rate"]
    for arm in ("grpo", "serl"):
        gain = round(100 * (demo["results"][f"warm start + {arm}"]["success_rate"] - warm), 1)
        assert run["gain_points"][arm] == gain
        assert data["gain_range_points"][arm] == [gain, gain]
        lo, hi = run["gain_ci95_points"][arm]  # paired over the quick run's 4 test rooms
        assert lo <= gain <= hi and demo["gains"][arm]["rooms"] == 4
    assert run["seed"] == 0 and run["threads"] == "1" and run["wall_s"] > 0
    assert "gain over the warm start" in capsys.readouterr().out


def test_online_async_figures_by_hand():
    from benchmarks.online_async import summarize

    timings = [
        {"iteration": 0, "iteration_s": 9.0, "rollout_s": 5.0, "update": {}},  # the start: not steady
        {"iteration": 1, "iteration_s": 2.0, "rollout_s": 1.5, "update": {}},
        {"iteration": 2, "iteration_s": 2.0, "rollout_s": 0.5, "update": {}},
    ]
    sync = summarize(0, timings, [{"success_rate": 0.5}], wall=20.0, cpu=13.0)
    assert sync["steady_iterations_per_s"] == 0.5 and sync["process_iterations_per_s"] == 3 / 20
    assert sync["rollout_idle"] == 0.5 and sync["trainer_idle"] == 0.5 and sync["ceiling"] == 2.0
    stale = [
        dict(t, update={"rollout_wait_s": 0.25, "producer_idle_s": 0.5, "producer_generate_s": 1.0}) for t in timings
    ]
    k1 = summarize(1, stale, [{"success_rate": 0.5}], wall=20.0, cpu=20.0)
    assert k1["trainer_idle"] == 0.5 / 4 and k1["rollout_idle"] == 1.0 / 4 and "ceiling" not in k1


def test_async_learning_reads_success_at_a_wall_time():
    from benchmarks.async_learning import success_at

    points = [(10.0, 0.2), (20.0, 0.4), (30.0, 0.5)]
    assert [success_at(points, t) for t in (5.0, 10.0, 25.0, 99.0)] == [0.2, 0.2, 0.4, 0.5]


def test_serl_price_figures_by_hand():
    from benchmarks.serl_price import bootstrap_median, rows, summarize

    # four paired iterations: SERL 3, 2, 4, 2.2 s against GRPO 2 s each; the first and last measured the signal
    pairs = [
        {"serl_s": s, "grpo_s": 2.0, "teacher_signal": flag}
        for s, flag in ((3.0, True), (2.0, False), (4.0, False), (2.2, True))
    ]
    phases = [  # annotate stages of 1.5, 0.5, 1.0 s and none
        {"iteration_s": p["serl_s"], "annotate_s": a, "teacher_forward_s": t, "annotate_rest_s": None}
        for p, a, t in zip(pairs, (1.5, 0.5, 1.0, None), (1.0, 0.2, 0.5, None), strict=True)
    ]
    data = summarize(pairs, phases)
    assert data["ratio"]["median"] == pytest.approx((1.1 + 1.5) / 2)  # ratios 1.5, 1.0, 2.0, 1.1
    assert data["ratio_apart"]["with_signal"]["median"] == pytest.approx((1.5 + 1.1) / 2)
    assert data["ratio_apart"]["without_signal"]["median"] == pytest.approx(1.5)
    assert data["ratio_of_sums"] == pytest.approx(11.2 / 8.0)
    assert data["teacher_forward_per_grpo_iteration"]["median"] == pytest.approx(0.25)  # 0.5, 0.1, 0.25
    assert "annotate_rest_s" not in data["serl"]  # never measured
    # the same batch: 3 / (3 - 1.5), 2 / 1.5, 4 / 3; the last iteration has no annotate stage
    same = data["same_batch_ratio"]
    assert same["all"]["n"] == 3 and same["all"]["median"] == pytest.approx(4 / 3)
    assert same["with_signal"]["median"] == pytest.approx(2.0) and same["without_signal"]["max"] == pytest.approx(4 / 3)
    low, high = data["ratio"]["ci95"]
    assert 1.0 <= low <= data["ratio"]["median"] <= high <= 2.0
    assert bootstrap_median([1.2] * 5) == (1.2, 1.2)
    assert len(rows(data)[0]) == 5
