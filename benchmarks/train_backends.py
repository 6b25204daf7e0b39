"""One GRPO update on the torch backend against DeepSpeed ZeRO stages 1, 2 and 3.

    python -m benchmarks.train_backends [--preset small] [--episodes 8] [--turns 3] [--prompt-tokens 384]
                                        [--action-tokens 24] [--micro-batch-tokens 4096] [--repeats 3]
                                        [--threads 1] [--seed 0] [--out FILE]

Writes ``benchmarks/results/train_backends.json`` unless ``--out`` is given.

The model is ``serl model init``'s preset (``small`` by default: ~25M parameters, random
weights); the batch is synthetic: ``--episodes`` episodes of ``--turns`` turns, prompts and
replies of random token ids (seeded) of the given lengths, behaviour log-probs from the
model itself, half of each group of 4 successful -- every turn carries a gradient. What a
step costs depends on the token counts, not on what the tokens say.

Each backend runs in its own process (so one's memory does not count against another),
one process per backend: on a single process ZeRO partitions nothing across devices, so
this measures the engine's overhead, not its memory savings -- those need several GPUs.
In each process: the learner is built, one untimed update warms up, then ``--repeats``
updates are timed (median reported). ``peak RSS MB`` is the process's high-water mark over
the timed updates (``VmHWM`` after resetting it through ``/proc/self/clear_refs``; where
that is unavailable, the process's lifetime peak, and the JSON says ``peak_reset: false``).
DeepSpeed runs on the CPU accelerator with gloo, fp32, serl's torch AdamW.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import report, reset_peak_rss, status_kb

BACKENDS = ("torch", "zero1", "zero2", "zero3")


def make_episodes(model_dir: str, args) -> list:
    import random

    from serl_cli.artifacts.records import make_episode, make_turn
    from serl_cli.models.loading import load_model
    from serl_cli.training.scoring import ScoreItem, score

    model, tokenizer = load_model(model_dir)
    model.eval()
    rng = random.Random(args.seed)
    vocab = len(tokenizer)
    episodes = []
    for e in range(args.episodes):
        turns = [
            make_turn(
                turn=t,
                prompt_ids=[rng.randrange(3, vocab) for _ in range(args.prompt_tokens)],
                action_ids=[rng.randrange(3, vocab) for _ in range(args.action_tokens)],
                state_key=str(t),
            )
            for t in range(args.turns)
        ]
        win = e % 4 < 2
        episodes.append(
            make_episode(turns, task_id=e // 4, group_id=e // 4, rollout_index=e % 4, reward=float(win), success=win)
        )
    scores = iter(score(model, tokenizer, [ScoreItem(t.prompt_ids, t.action_ids) for ep in episodes for t in ep.turns]))
    for ep in episodes:
        for t in ep.turns:
            t.behaviour_logprobs = next(scores)
    return episodes


def measure(backend: str, model_dir: str, args) -> dict:
    """One backend, in this process."""
    from serl_cli.training.deepspeed_config import DeepSpeedConfig
    from serl_cli.training.learner import Learner
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import TrainConfig

    episodes = make_episodes(model_dir, args)
    stage = None if backend == "torch" else int(backend[-1])
    cfg = TrainConfig(
        algo="grpo",
        backend="torch" if stage is None else "deepspeed",
        seed=args.seed,
        threads=args.threads,
        deepspeed=DeepSpeedConfig(zero_stage=stage),
        optim=OptimConfig(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens),
    )
    t0 = time.perf_counter()
    learner = Learner(model_dir, cfg)
    setup_s = time.perf_counter() - t0
    learner.update(episodes, 1.0)  # warm-up
    reset = reset_peak_rss()
    times, tokens = [], 0
    for _ in range(args.repeats):
        m = learner.update(episodes, 1.0)
        times.append(m["timing"]["update_s"])
        tokens = m["action_tokens"]
    hwm_kb = status_kb("VmHWM")
    return {
        "backend": backend,
        "update_s": statistics.median(times),
        "update_s_all": times,
        "setup_s": setup_s,
        "peak_rss_mb": hwm_kb / 1024.0 if hwm_kb else None,
        "peak_reset": reset,
        "action_tokens": tokens,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--episodes", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--action-tokens", type=int, default=24)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--one", choices=BACKENDS, help=argparse.SUPPRESS)  # internal: measure one backend
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()

    from serl_cli.models.loading import set_torch_threads

    set_torch_threads(args.threads)
    if args.one:
        print("RESULT " + json.dumps(measure(args.one, args.model, args)), flush=True)
        return

    from serl_cli.models.tiny import init_model

    results = []
    with tempfile.TemporaryDirectory(prefix="serl-train-backends-") as tmp:
        model_dir = str(init_model(args.preset, Path(tmp) / args.preset, _corpus(), seed=args.seed))
        # the children report on stdout: pass every setting on except --out (as --out=F or --out F)
        passthrough, skip_next = [], False
        for a in sys.argv[1:]:
            if skip_next:
                skip_next = False
            elif a == "--out":
                skip_next = True
            elif not a.startswith("--out="):
                passthrough.append(a)
        for backend in BACKENDS:
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.train_backends",
                    *passthrough,
                    "--one",
                    backend,
                    "--model",
                    model_dir,
                ],
                capture_output=True,
                text=True,
            )
            line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(f"{backend}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
                sys.exit(1)
            results.append(json.loads(line[len("RESULT ") :]))
            print(f"  {backend}: update {results[-1]['update_s']:.3f} s", flush=True)
    base = results[0]["update_s"]
    rows = [
        [
            r["backend"],
            f"{r['update_s']:.3f}",
            f"{r['update_s'] / base:.2f}",
            f"{r['setup_s']:.1f}",
            f"{r['peak_rss_mb']:.0f}" if r["peak_rss_mb"] else "n/a",
        ]
        for r in results
    ]
    report(
        "train_backends",
        f"One GRPO update, {args.preset} preset, {args.episodes} episodes x {args.turns} turns "
        f"({results[0]['action_tokens']} action tokens, prompts {args.prompt_tokens} tokens), 1 process, "
        f"{args.threads} thread(s), median of {args.repeats}",
        ["backend", "update s", "x torch", "setup s", "peak RSS MB"],
        rows,
        {
            "preset": args.preset,
            "episodes": args.episodes,
            "turns": args.turns,
            "prompt_tokens": args.prompt_tokens,
            "action_tokens": args.action_tokens,
            "micro_batch_tokens": args.micro_batch_tokens,
            "repeats": args.repeats,
            "threads": args.threads,
            "seed": args.seed,
            "processes": 1,
            "results": results,
        },
        args.out,
    )


def _corpus() -> list[str]:
    """WebShop text for the tokenizer (the synthetic catalog: no data needed), as ``serl model init`` trains it."""
    from serl_cli.rollout.default_model import tokenizer_corpus
    from serl_cli.rollout.worlds import EnvConfig, build_world

    return tokenizer_corpus(build_world(EnvConfig(name="webshop", split="train", settings={"catalog": "synthetic"})))


if __name__ == "__main__":
    main()
