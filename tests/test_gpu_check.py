"""``benchmarks/gpu_check.sh --smoke``: the prepared GPU check runs end to end on a CPU.

The same script, on tiny shapes: model build, the engine (vLLM where installed, else hf),
a Sokoban rollout, one DeepSpeed ZeRO-2 update in bf16 (the torch backend without
DeepSpeed) with the engine-trainer mismatch, the in-memory weight sync and one online
iteration. The GPU figures themselves (MFU, vLLM throughput) exist only on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from benchmarks.gpu_check import BF16_PEAK, SHAPES, bf16_peak

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


def test_smoke_runs_every_stage_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "SERL_THREADS": "1", "COLUMNS": "200"}
    p = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_check.sh"), "--smoke", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        cwd=ROOT,
        check=False,
    )
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
        )
    }
    assert r["precision"] == "cpu bf16" and r["backend"] in ("deepspeed", "torch")
    assert r["serl_engine_tokens_per_s"] > 0 and r["rollout_tokens_per_s"] > 0 and r["train_tokens_per_s"] > 0
    assert r["turns_with_gradient"] == r["turns"] > 0 and r["optimizer_steps"] == 1  # synthetic rewards: all turns
    assert 0 <= r["logp_mismatch_mean"] <= r["logp_mismatch_max"] < 0.5  # engine vs trainer, both bf16
    assert r["trainer_peak_memory_bytes"] > 0 and r["mfu"] is None  # no bf16 peak for a CPU
    assert r["online"]["iteration_s"] > 0
    assert "MFU %" in p.stdout and "smoke" in p.stdout  # the table
