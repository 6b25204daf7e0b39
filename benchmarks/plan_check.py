"""``serl plan``'s estimate against measured peaks: the tiny and small presets on the CPU.

    python -m benchmarks.plan_check [--configs NAME,...] [--out FILE]

Writes ``benchmarks/results/plan_check.json`` unless ``--out`` is given; the table is
docs/SCALING.md's validation table.

Each config builds its preset (``serl model init --preset``), then in processes of its own (one
measurement at a time, one torch thread each; ZeRO configs as two gloo ranks under torchrun)
loads a :class:`~serl_cli.training.learner.Learner` and runs one GRPO update of two micro-batches
of ``micro_batch_tokens`` padded tokens each (rows of ``prompt`` + ``reply`` tokens; every
reply scored, entropy bonus on), fp32 as on any CPU, then saves a resumable checkpoint
(``Learner.save``: under ZeRO-3 every rank gathers the whole model). The measured figures are
each rank's peak resident memory above its RSS just before the learner was built (after a
throw-away update on one row and a throw-away save, so that the libraries' lazy set-up -- a
first ``save_pretrained`` holds one more copy of the weights -- is not counted;
``benchmarks.peak``): over loading and the update, and over the save (the peak restarted when
it begins). The plan's figures are :func:`serl_cli.training.plan.estimate` for the same shape
and settings with ``device="cpu"``: the largest of its start and update phases, and its save
phase. The ratios are measured / plan.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Check:
    name: str
    preset: str
    backend: str = "torch"
    zero_stage: int = 0
    ranks: int = 1
    micro_batch_tokens: int = 4096
    prompt: int = 448
    reply: int = 64
    checkpointing: bool = False


CHECKS = [
    Check("tiny-torch", "tiny"),
    Check("tiny-torch-ckpt", "tiny", checkpointing=True),
    Check("small-torch", "small"),
    Check("small-torch-ckpt", "small", checkpointing=True, micro_batch_tokens=8192),
    Check("tiny-zero2", "tiny", "deepspeed", 2, 2),
    Check("small-zero2", "small", "deepspeed", 2, 2),
    Check("tiny-zero3", "tiny", "deepspeed", 3, 2),
    Check("small-zero3", "small", "deepspeed", 3, 2),
]


def layout(check: Check):
    from serl_cli.training.memory import Layout

    return Layout(
        backend=check.backend,
        zero_stage=check.zero_stage,
        ranks=check.ranks,
        ranks_per_node=check.ranks,
        half=False,
        device="cpu",
        gradient_checkpointing=check.checkpointing,
        micro_batch_tokens=check.micro_batch_tokens,
        reply_tokens=check.reply,
        prompt_tokens=check.prompt,
        engine="none",
    )


def planned(check: Check, model_dir: str) -> dict:
    from serl_cli.models.shapes import model_shape
    from serl_cli.training.memory import GiB
    from serl_cli.training.plan import estimate

    plan = estimate(model_shape(model_dir), layout(check))
    figures = {p.name: p.bytes / 2**20 for p in plan.phases}
    update = next(p for p in plan.phases if p.name == "update")
    return {
        "plan_mb": max(mb for name, mb in figures.items() if name != "save"),
        "plan_save_mb": figures["save"],
        "plan_phases_mb": figures,
        "plan_items_mb": {i.name: i.bytes / 2**20 for i in update.items},
        "params": plan.shape.params,
        "gib": GiB,
    }


# -- the measured side (one process per rank) -----------------------------------------------------
def episodes(check: Check, vocab: int, rows: int) -> list:
    """``rows`` single-turn episodes in groups of two (one success, one failure: advantages +-1)."""
    import random

    from serl_cli.artifacts.records import make_episode, make_turn

    rng = random.Random(0)
    out = []
    for e in range(rows):
        turn = make_turn(
            turn=0,
            prompt_ids=[rng.randrange(3, vocab) for _ in range(check.prompt)],
            action_ids=[rng.randrange(3, vocab) for _ in range(check.reply)],
            behaviour_logprobs=[-8.0] * check.reply,
            state_key=f"{e}",
        )
        win = e % 2 == 0
        out.append(
            make_episode([turn], task_id=e // 2, group_id=e // 2, rollout_index=e % 2, reward=float(win), success=win)
        )
    return out


def one(check: Check, model_dir: str) -> dict:
    import gc

    import torch

    from benchmarks.peak import BlockPeak
    from serl_cli.training.deepspeed_config import DeepSpeedConfig
    from serl_cli.training.learner import Learner
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import TrainConfig

    torch.set_num_threads(1)
    cfg = TrainConfig(
        algo="grpo",
        backend=check.backend,
        device="cpu",
        dtype="fp32",
        threads=1,
        gradient_checkpointing=check.checkpointing,
        entropy_coef=0.001,
        deepspeed=DeepSpeedConfig(zero_stage=check.zero_stage or None),
        optim=OptimConfig(lr=1e-6, micro_batch_tokens=check.micro_batch_tokens),
    )
    if check.backend == "deepspeed":  # the process group first: its buffers are not the model's
        from serl_cli.training.distributed import import_deepspeed, init_distributed

        init_distributed(import_deepspeed())
    warm = Learner(model_dir, cfg)
    vocab = len(warm.tokenizer)
    warm.update(episodes(check, vocab, 2 * check.ranks), 1.0)
    with tempfile.TemporaryDirectory(prefix="serl-plan-save-") as tmp:
        warm.save(Path(tmp) / "checkpoint")  # the first save's lazy set-up (transformers, safetensors)
    del warm
    gc.collect()
    rows = check.micro_batch_tokens // (check.prompt + check.reply)
    batch = episodes(check, vocab, 2 * rows)
    with BlockPeak() as peak:
        learner = Learner(model_dir, cfg)
        metrics = learner.update(batch, 1.0)
    with tempfile.TemporaryDirectory(prefix="serl-plan-save-") as tmp, BlockPeak() as save:
        learner.save(Path(tmp) / "checkpoint")  # every rank enters; rank 0 writes the model files
    rank = int(os.environ.get("RANK", "0"))
    return {
        "rank": rank,
        "peak_mb": peak.extra_mb,
        "save_mb": save.peak_mb - peak.start_mb,  # above the same baseline as the update's
        "rss_before_mb": peak.start_mb,
        "turns": metrics["turns"],
    }


def measure(check: Check, model_dir: str, timeout_s: float = 3600) -> dict:
    """Every rank's figure, from a process (or a torchrun group) of its own."""
    from benchmarks.peak import MALLOC_ENV

    env = {**os.environ, **MALLOC_ENV, "OMP_NUM_THREADS": "1", "SERL_THREADS": "1", "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory(prefix="serl-plan-check-") as tmp:
        out = Path(tmp) / "rank"
        args = ["-m", "benchmarks.plan_check", "--one", json.dumps(asdict(check)), "--model", model_dir, f"--out={out}"]
        launcher = [sys.executable]
        if check.ranks > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(check.ranks)]
        proc = subprocess.run([*launcher, *args], capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT)
        files = sorted(Path(tmp).glob("rank*.json"))
        if proc.returncode != 0 or len(files) != check.ranks:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            return {"error": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"}
        ranks = [json.loads(f.read_text()) for f in files]
    return {
        "rank_figures": ranks,
        "measured_mb": max(r["peak_mb"] for r in ranks),
        "measured_save_mb": max(r["save_mb"] for r in ranks),
    }


# -- published per-parameter figures at 1.5B and 7B ------------------------------------------------
def published(gpus: int = 8) -> list[dict]:
    """Model states per GPU (weights, gradients, optimizer; bf16 with fp32 Adam) by serl's plan,
    by DeepSpeed's estimators (``estimate_zero2_model_states_mem_needs`` / ``zero3``, no offload)
    and by the ZeRO paper (Rajbhandari et al. 2020, Fig. 1: K = 12, Psi parameters, N GPUs:
    baseline (2 + 2 + K) Psi, P_os+g 2 Psi + (2 + K) Psi / N, P_os+g+p (2 + 2 + K) Psi / N)."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    from serl_cli.models.shapes import KNOWN_SHAPES
    from serl_cli.training.memory import Layout, model_states

    rows = []
    for name in ("Qwen/Qwen2.5-1.5B", "Qwen/Qwen2.5-7B"):
        shape = KNOWN_SHAPES[name]
        p = shape.params
        for backend, stage, n in (("torch", 0, 1), ("deepspeed", 2, gpus), ("deepspeed", 3, gpus)):
            lay = Layout(backend=backend, zero_stage=stage, ranks=n, half=True)
            states = [i for i in model_states(shape, lay) if i.name in ("weights", "gradients", "optimizer")]
            serl = sum(i.bytes for i in states)
            if stage == 2:
                ds = estimate_zero2_model_states_mem_needs(p, num_gpus_per_node=n, cpu_offload=False)[1]
                paper = 2 * p + 14 * p / n
            elif stage == 3:
                ds = estimate_zero3_model_states_mem_needs(p, shape.largest_tensor, n, 1, cpu_offload=False)[1]
                ds -= 4 * shape.largest_tensor  # its gathered-layer term: serl counts that apart
                paper = 16 * p / n
            else:
                ds, paper = None, 16 * p
            rows.append(
                {"model": name, "params": p, "backend": backend, "stage": stage, "gpus": n}
                | {"serl_gib": serl / 2**30, "deepspeed_gib": ds / 2**30 if ds else None, "paper_gib": paper / 2**30}
            )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default=None, help="comma list of " + ", ".join(c.name for c in CHECKS))
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--from", dest="source", default=None, help="re-plan the measured figures of an earlier JSON")
    args = ap.parse_args(argv)
    from benchmarks.common import report, write_json

    if args.one:
        data = one(Check(**json.loads(args.one)), args.model)
        write_json(f"{args.out}{data['rank']}.json", data)
        return data
    chosen = CHECKS if not args.configs else [c for c in CHECKS if c.name in args.configs.split(",")]
    from serl_cli.models.tiny import init_model
    from serl_cli.rollout.default_model import tokenizer_corpus
    from serl_cli.rollout.worlds import EnvConfig, build_world

    corpus = tokenizer_corpus(build_world(EnvConfig(name="sokoban", split="train")))
    earlier = {}
    if args.source:  # the measurements do not depend on the estimate: re-plan them
        for r in json.loads(Path(args.source).read_text())["results"]:
            if "measured_mb" in r:
                earlier[r["name"]] = {k: r[k] for k in ("rank_figures", "measured_mb", "measured_save_mb") if k in r}
    results = []
    with tempfile.TemporaryDirectory(prefix="serl-plan-models-") as tmp:
        models = {}
        for check in chosen:
            if check.preset not in models:
                models[check.preset] = str(init_model(check.preset, Path(tmp) / check.preset, corpus, seed=0))
            model = models[check.preset]
            r = {**asdict(check), **planned(check, model), **(earlier.get(check.name) or measure(check, model))}
            if "measured_mb" in r:
                r["ratio"] = r["measured_mb"] / r["plan_mb"]
            if "measured_save_mb" in r:
                r["save_ratio"] = r["measured_save_mb"] / r["plan_save_mb"]
            results.append(r)
            got = f"{r['measured_mb']:.0f} MB measured" if "measured_mb" in r else r["error"]
            if "measured_save_mb" in r:
                got += f"; save: plan {r['plan_save_mb']:.0f} MB, {r['measured_save_mb']:.0f} MB measured"
            print(f"{check.name}: plan {r['plan_mb']:.0f} MB, {got}", flush=True)
    rows = [
        [
            r["name"],
            f"{r['params'] / 1e6:.1f}M",
            "torch" if r["backend"] == "torch" else f"ZeRO-{r['zero_stage']} x{r['ranks']}",
            r["micro_batch_tokens"],
            "yes" if r["checkpointing"] else "no",
            f"{r['plan_mb']:.0f}",
            f"{r['measured_mb']:.0f}" if "measured_mb" in r else r.get("error", "-"),
            f"{r['ratio']:.2f}" if "ratio" in r else "-",
            f"{r['plan_save_mb']:.0f}",
            f"{r['measured_save_mb']:.0f}" if "measured_save_mb" in r else "-",
            f"{r['save_ratio']:.2f}" if "save_ratio" in r else "-",
        ]
        for r in results
    ]
    columns = ["config", "params", "backend", "micro-batch tokens", "checkpointing", "plan MB", "measured MB", "ratio"]
    columns += ["save: plan MB", "save: measured MB", "save: ratio"]
    figures = published()
    from benchmarks.common import print_table

    print_table(
        "model states per GPU, GiB (bf16, Adam; 8 GPUs for ZeRO)",
        ["model", "backend", "serl plan", "DeepSpeed estimator", "ZeRO paper"],
        [
            [
                f["model"],
                f["backend"] if not f["stage"] else f"ZeRO-{f['stage']} x{f['gpus']}",
                f"{f['serl_gib']:.1f}",
                f"{f['deepspeed_gib']:.1f}" if f["deepspeed_gib"] else "-",
                f"{f['paper_gib']:.1f}",
            ]
            for f in figures
        ],
    )
    return report(
        "plan_check",
        "serl plan against measured CPU peaks (fp32, per rank)",
        columns,
        rows,
        {"results": results},
        args.out,
    )


if __name__ == "__main__":
    main()
