"""``serl plan``'s iteration-time estimate (``training.iteration_time``): its arithmetic against values
worked by hand, how the layouts compare under it, and the command's table and JSON for the paper
configs. An estimate from stated assumptions: nothing here is a measurement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import serl_in_process

from serl_cli.models.shapes import KNOWN_SHAPES
from serl_cli.training import iteration_time as it

ROOT = Path(__file__).resolve().parents[1]
Q7B = KNOWN_SHAPES["Qwen/Qwen2.5-7B"]  # 7,615,616,512 parameters; K and V: 28 layers x 2 x 4 heads x 128 x 2 bytes
H100 = it.Hardware("H100 SXM", flops=989e12, hbm_bytes_per_s=3.35e12, train_mfu=0.4, prefill_mfu=0.6)
ALFWORLD = it.Batch(episodes=128, turns=50, longest_turns=50, prompt_tokens=2048, reply_tokens=512)
COLOCATED = it.Placement("colocated", generating_gpus=8, tensor_parallel=2, training_gpus=8, sleeps=True)
SPLIT = it.Placement("split", generating_gpus=2, tensor_parallel=2, training_gpus=6)
STALE = it.Placement("split, k = 1", generating_gpus=2, tensor_parallel=2, training_gpus=6, staleness=1)


# -- the arithmetic, by hand ----------------------------------------------------------------------
def test_flops_and_seconds_of_a_7b_model_by_hand():
    """7e9 parameters, a million tokens: a forward is 1.4e16 FLOPs, an update 4.2e16 (5.6e16 with
    checkpointing's second forward); on 8 GPUs of 989 TFLOP/s at 40 % (3.1648e15 FLOP/s) the
    checkpointed update takes 17.69 s."""
    assert it.forward_flops(7e9, 1e6) == pytest.approx(1.4e16)
    assert it.update_flops(7e9, 1e6, checkpointing=False) == pytest.approx(4.2e16)
    assert it.update_flops(7e9, 1e6, checkpointing=True) == pytest.approx(5.6e16)
    assert it.compute_seconds(5.6e16, 8, 989e12, 0.4) == pytest.approx(17.695, abs=1e-3)
    assert it.compute_seconds(5.6e16, 4, 989e12, 0.4) == pytest.approx(2 * 17.695, abs=2e-3)  # half the GPUs


def test_a_decode_step_reads_the_weights_and_every_rows_kv_cache():
    """7e9 parameters in bf16 (14 GB) and 32 rows of 2,304 tokens at 57,344 bytes a token (4.228 GB):
    18.228 GB a step; on an engine of 2 GPUs at 3.35 TB/s each, 2.7206 ms."""
    step = it.decode_step_bytes(14e9, rows=32, context_tokens=2304, kv_per_token=57344)
    assert step == pytest.approx(18.2278e9, rel=1e-5)
    assert it.memory_seconds(step, 2, 3.35e12) == pytest.approx(2.7206e-3, rel=1e-4)


def test_generation_of_a_small_batch_by_hand():
    """4 episodes of one turn, 1,000-token prompts and 100-token replies, one engine of TP 2: every one of
    the 4,400 tokens at 2 FLOPs a parameter over 2 GPUs at 60 % is the throughput bound; the decode bound
    prefills the 4,000 prompt tokens so, then decodes 100 steps, each reading 15.23 GB of weights and 4
    rows x 1,050 tokens of KV cache (0.24 GB) at 2 x 3.35 TB/s."""
    batch = it.Batch(episodes=4, turns=1, longest_turns=1, prompt_tokens=1000, reply_tokens=100)
    p = 7_615_616_512
    throughput, decode = it.generation_seconds(Q7B, batch, SPLIT, H100)
    assert throughput == pytest.approx(2 * p * 4400 / (2 * 989e12 * 0.6), rel=1e-9)  # 0.05647 s
    step = 2 * p + 4 * 1050 * 57344
    assert decode == pytest.approx(2 * p * 4000 / (2 * 989e12 * 0.6) + 100 * step / (2 * 3.35e12), rel=1e-9)
    assert decode == pytest.approx(0.2823, abs=1e-4)  # decoding four rows: memory-bound, 5x the throughput bound


def test_the_iteration_takes_turns_or_the_longer_side():
    assert it.iteration_seconds(100, trainer=300, sync=15, sleep_wake=5, overlapped=False) == 420
    assert it.iteration_seconds(100, trainer=300, sync=15, sleep_wake=0, overlapped=True) == 315  # the trainer's side
    assert it.iteration_seconds(400, trainer=300, sync=15, sleep_wake=0, overlapped=True) == 415  # the producer's


def test_the_teacher_iterations_follow_lambdas_schedule():
    """The authors' schedule (lambda 0.5 decaying over 50 updates) scores 50 of 2,400 iterations; no
    decay, every one; distillation (skip_zero_advantage off), every one; lambda 0, none."""
    assert it.teacher_iterations(2400, 0.5, 50, skip_zero_advantage=True) == 50
    assert it.teacher_iterations(30, 0.5, 50, skip_zero_advantage=True) == 30
    assert it.teacher_iterations(2400, 0.5, 0, skip_zero_advantage=True) == 2400
    assert it.teacher_iterations(2400, 0.5, 50, skip_zero_advantage=False) == 2400
    assert it.teacher_iterations(2400, 0.0, 50, skip_zero_advantage=True) == 0
    assert it.run_ratio(1.3, 50, 2400) == pytest.approx((50 * 1.3 + 2350) / 2400)  # 1.00625
    assert it.run_ratio(1.3, 2400, 2400) == pytest.approx(1.3)


# -- the layouts under the model ------------------------------------------------------------------
def test_the_phases_scale_as_their_flops_say():
    """pi_old is one forward over the tokens, the teacher TEACHER_TOKEN_RATIO forwards (SERL's measured
    2.1x the update's tokens), the checkpointed update four, all on the same GPUs; GRPO has no teacher."""
    serl = it.estimate_iteration(Q7B, ALFWORLD, COLOCATED, H100, teacher=True, checkpointing=True)
    assert serl.teacher / serl.pi_old == pytest.approx(it.TEACHER_TOKEN_RATIO)
    assert serl.update / serl.pi_old == pytest.approx(4)
    plain = it.estimate_iteration(Q7B, ALFWORLD, COLOCATED, H100, teacher=True, checkpointing=False)
    assert plain.update / plain.pi_old == pytest.approx(3)
    # 7.6e9 x 16.4M tokens x 2 on 8 x 989 TFLOP/s at 40 %: 78.85 s
    assert serl.pi_old == pytest.approx(2 * Q7B.params * ALFWORLD.tokens / (8 * 989e12 * 0.4), rel=1e-9)
    grpo = it.estimate_iteration(Q7B, ALFWORLD, COLOCATED, H100, teacher=False, checkpointing=True)
    assert grpo.teacher == 0 and grpo.over_grpo == (1.0, 1.0)
    assert all(r > 1 for r in serl.over_grpo)


def test_generation_bounds_and_what_each_depends_on():
    """The decode bound is never below the throughput bound; it follows the longest episode's turns, the
    throughput bound the typical episode's; four engines of TP 2 beat one on both bounds."""
    for where in (COLOCATED, SPLIT):
        lo, hi = it.generation_seconds(Q7B, ALFWORLD, where, H100)
        assert hi >= lo > 0
    short = it.Batch(128, turns=10, longest_turns=50, prompt_tokens=2048, reply_tokens=512)
    lo10, hi10 = it.generation_seconds(Q7B, short, COLOCATED, H100)
    lo50, hi50 = it.generation_seconds(Q7B, ALFWORLD, COLOCATED, H100)
    assert lo10 == pytest.approx(lo50 / 5)
    assert hi10 < hi50 and hi10 > hi50 / 5  # the longest episode's decode steps stay
    four, one = it.generation_seconds(Q7B, ALFWORLD, COLOCATED, H100), it.generation_seconds(Q7B, ALFWORLD, SPLIT, H100)
    assert four[0] == pytest.approx(one[0] / 4) and four[1] < one[1]


def test_the_producer_at_k1_takes_rollout_off_the_critical_path():
    k0 = it.estimate_iteration(Q7B, ALFWORLD, SPLIT, H100, teacher=True, checkpointing=True)
    k1 = it.estimate_iteration(Q7B, ALFWORLD, STALE, H100, teacher=True, checkpointing=True)
    for slow, fast, generation in zip(k0.iteration, k1.iteration, k1.generation, strict=True):
        assert fast < slow
        assert fast >= max(k1.trainer, generation) + k1.sync  # never below either side
    # where the trainer is the longer side, the teacher's whole forward lands on the iteration
    assert k1.iteration[1] == pytest.approx(k1.trainer + k1.sync) and k1.over_grpo[1] > k0.over_grpo[1]


# -- the command ----------------------------------------------------------------------------------
def test_serl_plan_estimates_each_layouts_iteration_and_serls_ratio_to_grpo():
    """The paper's ALFWorld recipe: the three layouts' phases in seconds, SERL's iteration over GRPO's
    above 1 on each (its teacher), GRPO's recipe exactly 1; the assumptions and the batch in the JSON;
    over the run the teacher scores for the 50 updates lambda decays over."""
    serl = json.loads(serl_in_process("plan", str(ROOT / "experiments/alfworld/paper/serl.yaml"), "--json").stdout)
    time = serl["time"]
    assert time["assumptions"]["teacher_token_ratio"] == it.TEACHER_TOKEN_RATIO
    assert {"train_mfu", "prefill_mfu", "weight_sync_s", "sleep_wake_s", "left_out"} <= set(time["assumptions"])
    assert time["hardware"]["name"] == "H100 SXM" and "not a measurement" in time["estimate"]
    assert time["batch"]["tokens"] == 128 * 50 * (2048 + 512)  # 16 tasks x 8, ALFWorld's 50 turns
    assert (time["iterations"], time["teacher_iterations"]) == (2400, 50)
    rows = {r["name"]: r for r in time["layouts"]}
    assert list(rows) == ["split", "split, k = 1", "colocated"]
    assert (rows["colocated"]["engines"], rows["split"]["engines"], rows["split, k = 1"]["max_staleness"]) == (4, 1, 1)
    for row in rows.values():
        ratio, run = row["over_grpo"], row["over_grpo_run"]
        assert ratio["throughput_bound"] > 1 and ratio["decode_bound"] > 1 and row["teacher_s"] > 0
        assert 1 < run["decode_bound"] < ratio["decode_bound"]  # 50 of 2,400 iterations pay it
    slowest = {name: r["iteration_s"]["decode_bound"] for name, r in rows.items()}
    assert slowest["colocated"] < slowest["split"] and slowest["split, k = 1"] < slowest["split"]
    assert rows["colocated"]["sleep_wake_s"] > 0 == rows["split"]["sleep_wake_s"]

    grpo = json.loads(serl_in_process("plan", str(ROOT / "experiments/alfworld/paper/grpo.yaml"), "--json").stdout)
    for row in grpo["time"]["layouts"]:
        assert row["teacher_s"] == 0 and row["over_grpo"] == {"throughput_bound": 1.0, "decode_bound": 1.0}

    text = serl_in_process("plan", str(ROOT / "experiments/webshop/paper/serl.yaml"))
    assert text.returncode == 0, text.stderr
    for needle in ("Iteration time, estimated for 8 x H100 SXM", "vs GRPO", "split, k = 1", "over the run"):
        assert needle in text.stdout, needle
    assert "none of it has run on a GPU" in text.stdout


def test_two_nodes_halve_the_colocated_trainers_phases():
    """--nodes 2: the colocated layout trains on 16 GPUs and generates on 8 engines, so pi_old, the
    teacher and the update take half the time of one node's; the split's single engine stays one."""
    path = str(ROOT / "experiments/alfworld/paper/serl.yaml")
    one = {r["name"]: r for r in json.loads(serl_in_process("plan", path, "--json").stdout)["time"]["layouts"]}
    two = json.loads(serl_in_process("plan", path, "--json", "--nodes", "2").stdout)["time"]["layouts"]
    two = {r["name"]: r for r in two}
    assert (two["colocated"]["train_gpus"], two["colocated"]["engines"]) == (16, 8)
    assert two["colocated"]["update_s"] == pytest.approx(one["colocated"]["update_s"] / 2, rel=1e-3)
    assert two["split"]["engines"] == 1
