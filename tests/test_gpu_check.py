"""``benchmarks/gpu_check.sh --smoke``: the prepared GPU check runs end to end on a CPU.

The same script, on tiny shapes: model build, the engine (vLLM where installed, else hf),
a Sokoban rollout, one DeepSpeed ZeRO-2 update in bf16 (the torch backend without
DeepSpeed) with the engine-trainer mismatch, the in-memory weight sync and one online
iteration. The GPU figures themselves (MFU, vLLM throughput) exist only on a GPU.

Its multi-GPU mode (``--multi``, ``benchmarks/gpu_check_multi.py``) runs two SERL iterations
per layout under torchrun; ``--multi --smoke`` runs the same phases on 2 gloo ranks on the CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from benchmarks.gpu_check import BF16_PEAK, SHAPES, bf16_peak
from benchmarks.gpu_check_multi import layouts

ROOT = Path(__file__).resolve().parent.parent


def test_shapes_are_qwen25s_and_peaks_are_dense_bf16():
    small, big = SHAPES["qwen2.5-0.5b"], SHAPES["qwen2.5-1.5b"]
    assert (
        small["hidden_size"],
        small["num_hidden_layers"],
        small["num_attention_heads"],
        small["num_key_value_heads"],
        small["intermediate_size"],
    ) == (896, 24, 14, 2, 4864)
    assert (
        big["hidden_size"],
        big["num_hidden_layers"],
        big["num_attention_heads"],
        big["num_key_value_heads"],
        big["intermediate_size"],
    ) == (1536, 28, 12, 2, 8960)
    assert small["vocab_size"] == big["vocab_size"] == 151936 and small["tie_word_embeddings"]
    assert bf16_peak("NVIDIA H200") == bf16_peak("NVIDIA H100 80GB HBM3") == 989e12
    assert bf16_peak("NVIDIA H100 PCIe") == 756e12 and bf16_peak("NVIDIA A100-SXM4-80GB") == 312e12
    assert bf16_peak("Tesla T4") is None and len(BF16_PEAK) == 4


def run_gpu_check(args: list[str], timeout: int, **env: str) -> subprocess.CompletedProcess:
    """``benchmarks/gpu_check.sh ARGS`` with one torch thread and a table wide enough to read."""
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), *args],
        capture_output=True,
        text=True,
        env={**os.environ, "SERL_THREADS": "1", "COLUMNS": "200", **env},
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )


@pytest.mark.slow
def test_smoke_runs_every_stage_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    p = run_gpu_check(["--smoke", "--device", "cpu", "--out", str(out)], timeout=300)
    data = json.loads(out.read_text()) if out.exists() else {}
    errors = {k: v.get("error") for r in data.get("results", []) for k, v in r["stages"].items() if v["status"] != "ok"}
    assert p.returncode == 0, f"{errors}\n{p.stderr[-4000:]}"

    assert data["ok"] and data["smoke"] and data["device"] == "cpu"
    (r,) = data["results"]
    assert {k: v["status"] for k, v in r["stages"].items()} == {
        k: "ok"
        for k in (
            "build",
            "engine_start",
            "raw_generation",
            "rollout",
            "trainer_start",
            "update",
            "weight_sync",
            "online_iteration",
            "serl_price",
            "online_async",
        )
    }
    assert r["precision"] == "cpu bf16" and r["backend"] in ("deepspeed", "torch")
    assert r["serl_engine_tokens_per_s"] > 0 and r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0
    assert r["turns_with_gradient"] == r["turns"] > 0 and r["optimizer_steps"] == 1  # synthetic rewards: all turns
    assert 0 <= r["logp_mismatch_mean"] <= r["logp_mismatch_max"] < 0.5  # engine vs trainer, both bf16
    assert r["trainer_peak_memory_bytes"] > 0 and r["mfu"] is None  # no bf16 peak for a CPU
    assert r["online"]["iteration_s"] > 0
    # the same iteration as SERL, its teacher scoring every turn: its time against GRPO's, and the annotate
    # stage outside the teacher's forward against that forward
    price = r["serl_price"]
    assert price["serl_over_grpo"] > 0 and price["annotate_rest_over_teacher"] > 0
    # the producer beside the trainer: the overlap is the share of its generation the trainer did not wait for
    a = r["online_async"]
    assert a["async_iteration_s"] > 0 and a["async_producer_generate_s"] > 0 and a["async_overlap"] <= 1
    assert "MFU %" in p.stdout and "smoke" in p.stdout  # the table


def test_multi_gpu_layouts_by_gpu_count():
    split, split_nccl, colocated, dp = layouts(4, smoke=False, have_vllm=True)
    assert (split["processes"], split["train_gpus"], split["rollout_gpus"], split["tp"]) == (2, [0, 1], [2, 3], 2)
    assert split_nccl == split | {"name": "split_nccl", "sync_path": "collective"}  # the same, synced by NCCL
    assert not split["sleep"] and colocated["sleep"] and (colocated["processes"], colocated["tp"]) == (4, 2)
    assert dp["data_parallel"] and dp["sleep"] and (dp["processes"], dp["tp"], dp["rollout_gpus"]) == (4, 2, None)
    split, _, colocated, dp = layouts(3, smoke=False, have_vllm=True)
    assert (split["processes"], split["rollout_gpus"], split["tp"], colocated["tp"]) == (1, [1, 2], 2, 2)
    assert (dp["processes"], dp["tp"]) == (3, 1)  # three engines of one GPU each
    split, _, colocated, dp = layouts(2, smoke=False, have_vllm=True)  # no room for tensor parallel 2 beside a trainer
    assert (split["processes"], split["rollout_gpus"], split["tp"], colocated["processes"]) == (1, [1], 1, 2)
    assert (dp["processes"], dp["tp"]) == (2, 1)
    (smoke,) = layouts(0, smoke=True, have_vllm=False)
    assert (smoke["processes"], smoke["engine"], smoke["train_gpus"]) == (2, "hf", None)


@pytest.mark.slow
def test_multi_smoke_times_every_phase_on_two_cpu_ranks(tmp_path):
    out = tmp_path / "gpu_check_multi.json"
    p = run_gpu_check(["--multi", "--smoke", "--out", str(out)], timeout=900, OMP_NUM_THREADS="1")
    data = json.loads(out.read_text()) if out.exists() else {}
    assert p.returncode == 0, f"{[r.get('error') for r in data.get('results', [])]}\n{p.stderr[-4000:]}"
    assert data["ok"] and data["smoke"]
    (res,) = data["results"]
    assert res["layout"]["name"] == "smoke" and [r["rank"] for r in res["ranks"]] == [0, 1]
    assert res["iterations"] == 2 and res["eval_episodes"] == 2  # a second rollout, then the evaluation
    assert 0 <= res["logp_mismatch_max"] < 1e-3  # the engine's log-probs against the trainer's pi_old
    for r in res["ranks"]:
        assert r["peak_memory_bytes"] > 0 and r["plan_estimate_bytes"] > 0  # serl plan's estimate beside it
        assert all(r[f"{p}_s"] >= 0 for p in ("rollout", "recompute", "teacher", "update"))
    assert any(line.startswith("serl: rank 1/2: teacher") for line in res["log"])  # rank 1 scored its share
    assert "plan GiB" in p.stdout and "smoke" in p.stdout  # the table
