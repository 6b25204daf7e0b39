"""The GPU check's multi-GPU mode: two SERL iterations of the online loop on 2-4 GPUs and an
evaluation after the second, in the layouts a paper run uses, with each rank's peak memory and
its seconds per phase.

    bash benchmarks/gpu_check.sh --multi                 # 2-4 GPUs, a few minutes per layout
    bash benchmarks/gpu_check.sh --multi --smoke         # the same phases on 2 gloo ranks on the CPU (CI)
    python -m benchmarks.gpu_check_multi --gpus 4 --shape qwen2.5-0.5b --out results/multi.json

Layouts, on N GPUs (every one ZeRO-3, ``serl train`` under torchrun, one process per GPU):

* ``split``: the trainer on GPUs 0..N-t-1, vLLM with tensor parallel t on the last t GPUs, of
  its own (t = 2 where N >= 3; on 2 GPUs t = 1); the update pushed into it in memory, one
  weight gathered at a time.
* ``split_nccl``: ``split`` with ``rollout.vllm.sync_path: collective``: each sync an NCCL broadcast from
  the trainer's rank 0 to the engine's workers (docs/VLLM.md). The JSON records each layout's sync path and
  the second iteration's largest log-prob gap between the engine and the trainer's π_old
  (``logp_mismatch_max``): weights the sync left wrong show as a gap far above the ``split`` run's.
* ``colocated``: the trainer on all N GPUs, one vLLM engine with tensor parallel min(2, N) on the
  first ones (rank 0's, serving every group), asleep while the trainer works
  (``rollout.vllm.sleep``): it starts before the trainer's state is on the GPU.
* ``data_parallel``: the paper configs' layout: the trainer on all N GPUs and one vLLM engine
  per t of them (t = 2 where N is even and at least 4, else 1), each generating its share of the
  task groups and of the evaluation, all asleep while the trainer works
  (``rollout.vllm.data_parallel``); every engine takes each weight sync.
* ``smoke``: 2 gloo processes on the CPU, fp32; vLLM where installed, else the hf engine
  (each process generating its own task groups).

Each runs two iterations on Sokoban with the model :func:`benchmarks.gpu_check.build_model`
builds (Qwen2.5 shapes, random weights, serl's tokenizer): SERL with the teacher scoring
every turn with a block (``annotate.skip_zero_advantage: false``), π_old recomputed, the
paper's entropy bonus (so every turn trains, whatever the random model's rewards). Each
rank's figures come from the second iteration's ``timings.jsonl`` row (``ranks``): its rollout and
the evaluation after it run on an engine woken from the sleep of the first update (``colocated``),
and on weights the first sync pushed. Its peak memory -- its
trainer process's: allocated on its GPU (vLLM's own processes are not in it), or its resident
set on a CPU -- and its seconds in rollout, recompute, teacher, update and sync. The
``plan GiB`` column holds ``serl plan``'s estimate of the rank's peak when :func:`run_layouts`
is given an ``estimate`` (a function of the layout's run config, the process count and the
rank, to bytes), else ``-``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("rollout", "recompute", "teacher", "update", "sync")


def layouts(gpus: int, smoke: bool, have_vllm: bool) -> list[dict]:
    """The layouts to run (module docstring) on ``gpus`` GPUs, or the CPU smoke layout."""
    if smoke:
        engine = "vllm" if have_vllm else "hf"
        return [dict(name="smoke", processes=2, train_gpus=None, rollout_gpus=None, tp=1, sleep=False, engine=engine)]
    tp = 2 if gpus >= 3 else 1
    both = min(2, gpus)
    split = dict(
        name="split",
        processes=gpus - tp,
        train_gpus=list(range(gpus - tp)),
        rollout_gpus=list(range(gpus - tp, gpus)),
        tp=tp,
        sleep=False,
        engine="vllm",
    )
    return [
        split,
        split | dict(name="split_nccl", sync_path="collective"),
        dict(
            name="colocated",
            processes=gpus,
            train_gpus=list(range(gpus)),
            rollout_gpus=None,
            tp=both,
            sleep=True,
            engine="vllm",
        ),
        dict(
            name="data_parallel",
            processes=gpus,
            train_gpus=list(range(gpus)),
            rollout_gpus=None,
            tp=2 if gpus % 2 == 0 and gpus >= 4 else 1,
            sleep=True,
            engine="vllm",
            data_parallel=True,
        ),
    ]


def run_config(layout: dict, model_dir: Path, out: Path, args) -> dict:
    """The online run's settings for ``layout`` (what ``serl train --config`` would read)."""
    gpu = not args.smoke
    return {
        "env": {"name": "sokoban", "split": "train", "max_turns": args.max_turns},
        "model": str(model_dir),
        "iterations": 2,  # the second's rollout and the evaluation follow a wake-up and a weight sync
        "seed": 0,
        "out": str(out),
        "rollout": {
            "engine": layout["engine"],
            "tasks": args.tasks,
            "group_size": args.group_size,
            "batch_size": args.tasks * args.group_size,
            "gpus": layout["rollout_gpus"],
            "threads": args.threads,
            # coupled: with hf each process samples its own groups (online.ranks)
            "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": args.max_new_tokens, "coupled": True},
            "vllm": {
                "tensor_parallel_size": layout["tp"],
                "gpu_memory_utilization": args.vllm_memory,
                "dtype": "bfloat16" if gpu else "float32",
                "enforce_eager": args.smoke or args.eager,
                "max_model_len": args.max_model_len,
                "sleep": layout["sleep"],
                "data_parallel": layout.get("data_parallel", False),
                "sync_path": layout.get("sync_path", "auto"),
            },
        },
        "train": {
            "algo": "serl",
            "backend": "deepspeed",
            "deepspeed": {"zero_stage": 3},
            "device": "cuda" if gpu else "cpu",
            "dtype": "bf16" if gpu else "fp32",
            "gpus": layout["train_gpus"],
            "recompute_logp_old": True,
            "entropy_coef": 0.001,  # the paper's: every turn trains, whatever the random model's rewards
            "gradient_checkpointing": args.gradient_checkpointing,
            "optim": {"lr": 1e-6, "micro_batch_tokens": args.micro_batch_tokens},
            "threads": args.threads,
        },
        "annotate": {"skip_zero_advantage": False, "teacher_sync_interval": 1},
        "eval": {"episodes": args.tasks, "every": 2, "temperature": 0.0},
    }


def worker(config_path: str) -> None:
    """One process of a layout's run (under torchrun): the online loop itself."""
    from serl_cli import config as cfgmod
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.loop import run_online

    cfg = cfgmod.from_dict(OnlineConfig, json.loads(Path(config_path).read_text()), config_path)
    run_online(cfg, overwrite=True)


def launch(layout: dict, config_path: Path, timeout_s: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.setdefault("OMP_NUM_THREADS", "1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(layout["processes"])]
    cmd += ["-m", "benchmarks.gpu_check_multi", "--worker", str(config_path)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, cwd=ROOT, check=False)


def rank_rows(run: Path, estimate=None, cfg: dict | None = None) -> tuple[list[dict], dict]:
    """Each rank's figures of the run's (last) iteration, and the iteration's own."""
    last = json.loads((run / "timings.jsonl").read_text().splitlines()[-1])
    rows = []
    for r in last["ranks"]:
        row = {"rank": r["rank"], "peak_memory_bytes": r["peak_memory_bytes"]}
        row.update({f"{p}_s": r.get(f"{p}_s") for p in PHASES})
        row["plan_estimate_bytes"] = estimate(cfg, len(last["ranks"]), r["rank"]) if estimate else None
        rows.append(row)
    iterations = len((run / "timings.jsonl").read_text().splitlines())
    evaluated = json.loads((run / f"iter_{iterations - 1:04d}" / "eval.json").read_text())
    return rows, {
        "iteration_s": last["iteration_s"],
        "weight_sync_s": last["update"].get("weight_sync_s"),
        "weight_sync_path": last["update"].get("weight_sync_path"),
        "logp_mismatch_max": json.loads((run / "metrics.jsonl").read_text().splitlines()[-1]).get("logp_mismatch_max"),
        "iterations": iterations,
        "eval_episodes": evaluated["episodes"],
    }


def plan_estimate(smoke: bool):
    """``serl plan``'s peak for a layout's run config, per rank, in bytes (the ``plan GiB``
    column): on GPUs against one GPU's memory, on a CPU (``--smoke``) against the host's."""
    import torch

    from serl_cli import config as cfgmod
    from serl_cli.models.shapes import model_shape
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.plan import Machine, host_memory_bytes, layout_of
    from serl_cli.training.memory import GiB
    from serl_cli.training.plan import estimate

    def peak(cfg: dict, world: int, rank: int) -> int:
        run = cfgmod.from_dict(OnlineConfig, cfg)
        own = len(run.rollout.gpus or []) if run.rollout.engine == "vllm" else 0
        memory = host_memory_bytes() if smoke else torch.cuda.get_device_properties(0).total_memory
        machine = Machine(gpus=world + own, gpu_memory_gb=memory / GiB)
        layout = layout_of(run, machine, device="cpu" if smoke else "cuda")
        return int(estimate(model_shape(run.model), layout).peak.bytes)

    return peak


def run_layouts(model_dir: Path, work: Path, args, log, estimate=None) -> list[dict]:
    """Every layout's iteration, each recorded as ok (with its ranks' figures) or as its error."""
    import importlib.util

    import torch

    gpus = args.gpus or (torch.cuda.device_count() if not args.smoke else 0)
    results = []
    for layout in layouts(gpus, args.smoke, importlib.util.find_spec("vllm") is not None):
        run = work / f"run-{layout['name']}"
        cfg = run_config(layout, model_dir, run, args)
        path = work / f"{layout['name']}.json"
        path.write_text(json.dumps(cfg))
        log(f"-- {layout['name']}: {layout['processes']} process(es), engine {layout['engine']}")
        t0 = time.perf_counter()
        res = {"layout": layout, "seconds": None, "status": "error"}
        try:
            p = launch(layout, path, args.layout_timeout)
            res["seconds"] = round(time.perf_counter() - t0, 1)
            res["log"] = [ln for ln in p.stderr.splitlines() if ln.startswith("serl: rank")]
            if p.returncode != 0:
                res["error"] = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1]
                log(p.stderr[-4000:])
            else:
                res["ranks"], extra = rank_rows(run, estimate, cfg)
                res.update(extra, status="ok")
        except subprocess.TimeoutExpired:
            res["error"] = f"no result within {args.layout_timeout} s"
        results.append(res)
    return results


def table(results: list[dict]) -> list[list]:
    def gib(v):
        return "-" if v is None else v / 2**30

    rows = []
    for res in results:
        for r in res.get("ranks") or [{"rank": "-"}]:
            row = [res["layout"]["name"], r["rank"], gib(r.get("peak_memory_bytes")), gib(r.get("plan_estimate_bytes"))]
            row += ["-" if r.get(f"{p}_s") is None else r[f"{p}_s"] for p in PHASES]
            rows.append(row + [res["status"] if res["status"] == "ok" else res.get("error", "error")])
    return rows


COLUMNS = ["layout", "rank", "peak GiB", "plan GiB", *[f"{p} s" for p in PHASES], "status"]


def parse_args(argv=None):
    from benchmarks.common import add_run_size_options, fill_defaults

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--multi", action="store_true", help="(the mode gpu_check.sh dispatches on)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--smoke", action="store_true", help="2 gloo ranks on the CPU, tiny shapes (CI)")
    ap.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; 2-4)")
    ap.add_argument("--shape", default=None, help="a gpu_check shape (default qwen2.5-1.5b; smoke: smoke)")
    add_run_size_options(ap)
    ap.add_argument("--vllm-memory", type=float, default=0.35, help="vLLM's share of each of its GPUs")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--layout-timeout", type=float, default=420.0, help="seconds for one layout's run")
    ap.add_argument("--work", default=None, help="where the model and runs go (default: a temp dir, removed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    big = not args.smoke
    defaults = dict(
        shape="qwen2.5-1.5b" if big else "smoke",
        tasks=16 if big else 2,
        group_size=8 if big else 2,
        max_turns=4 if big else 2,
        max_new_tokens=64 if big else 6,
        micro_batch_tokens=16384 if big else 4096,
        threads=None if big else 1,
    )
    fill_defaults(args, defaults)
    return args


def main(argv=None) -> dict:
    import torch

    from benchmarks.common import show_and_write, work_dir
    from benchmarks.gpu_check import build_model

    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return {"ok": True}
    if not args.smoke and not 2 <= (args.gpus or torch.cuda.device_count()) <= 4:
        raise SystemExit(f"gpu_check --multi runs on 2-4 GPUs; this machine shows {torch.cuda.device_count()}")
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if args.smoke else (lambda m: print(m, flush=True))
    t0 = time.perf_counter()
    device = "cpu" if args.smoke else torch.cuda.get_device_name(0)
    with work_dir(args.work, "serl-gpu-check-multi-") as work:
        dtype = torch.float32 if args.smoke else torch.bfloat16
        model_dir = build_model(args.shape, work / args.shape, torch.device("cpu"), dtype)
        results = run_layouts(model_dir, work, args, log, plan_estimate(args.smoke))
    payload = {
        "benchmark": "gpu_check_multi",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": device,
        "gpus": 0 if args.smoke else (args.gpus or torch.cuda.device_count()),
        "smoke": args.smoke,
        "wall_s": round(time.perf_counter() - t0, 1),
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "worker")},
        "results": results,
        "ok": bool(results) and all(r["status"] == "ok" for r in results),
    }
    show_and_write(
        f"serl multi-GPU check on {device} ({payload['wall_s']} s)", COLUMNS, table(results), payload, args.out
    )
    return payload


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
