"""A real pretrained chat model on the CPU: rollout and update throughput, and where an online iteration's time goes.

    serl model fetch smollm2-135m-instruct --out models/smollm2
    python -m benchmarks.real_model --model models/smollm2 [--threads 1,2] [--rows 8] [--new-tokens 32]
                                    [--no-iteration] [--out benchmarks/results/real_model.json]

The model is SmolLM2-135M-Instruct as ``serl model fetch`` installs it (the Q4_1 GGUF dequantized, saved
in fp32 or bf16; the CPU computes in fp32 either way). For each torch thread count of ``--threads``:

1. **rollout**: serl's hf engine (``HFEngine.generate``, one batched ``generate`` with a KV cache) on
   ``--rows`` first-turn Sokoban prompts in serl's own style (the environment's rules in a system
   message: about 330 tokens each), at T 1.0 with ``--new-tokens`` new tokens. A reply stops at
   ``<|im_end|>``, so rows finish at different steps; the generated tokens counted are those kept (up to
   and including the end token). One untimed warm-up call first.
2. **update**: one GRPO update (``Learner.update``, one optimizer step, micro-batches of 2,048 tokens) on
   those replies as one-turn episodes whose groups half succeed (every turn has a gradient), full
   fine-tuning and LoRA rank 8 (all linear layers). The tokens of an update are the prompt and reply
   tokens its forward and backward passes run over; the reply tokens are the ones with a loss. Beside
   it, a forward pass without gradients over the same batch: the recompute of pi_old, which is also
   what SERL's teacher costs on the same tokens (its prompt is longer by the hindsight block).
3. **an online iteration**: ``run_online`` for one SERL iteration of
   ``experiments/smollm2/sokoban.yaml`` (4 tasks x 2 rollouts, at most 3 turns, pi_old recomputed, no
   evaluation), its phases from ``timings.jsonl``: rollout, pi_old, teacher (its forward and the rest of
   the annotation), update, and the rest of the iteration (the checkpoint: 0.5 GB of weights and 1 GB of
   AdamW state in fp32, and the books).

Rates are per wall-clock second, and per CPU second of the process beside them (the machine may be
shared: CPU time leaves out the waits for a core). The load average at the start and the end of each
section goes to the JSON, since a loaded machine stretches every figure.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
from pathlib import Path

from benchmarks.common import Stopwatch, report
from serl_cli.artifacts.records import Episode, make_episode, make_turn
from serl_cli.models.loading import load_model, set_torch_threads
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.engines.hf import HFEngine
from serl_cli.rollout.prompts import PromptConfig, build_messages, render_prompt_ids
from serl_cli.rollout.worlds import EnvConfig, build_world

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "experiments" / "smollm2" / "sokoban.yaml"
MICRO_BATCH_TOKENS = 2048


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def sokoban_prompts(tokenizer, rows: int) -> list[list[int]]:
    """The first turn of ``rows`` Sokoban train rooms in serl's own prompt (rules in the system message)."""
    world = build_world(EnvConfig(name="sokoban", split="train"))
    prompts = []
    for task in range(rows):
        step = world.new_episode("train").reset(task)
        messages = build_messages(
            world.rules, "Push every box onto a goal.", [], step.observation, step.admissible_actions, PromptConfig()
        )
        prompts.append(render_prompt_ids(tokenizer, messages))
    return prompts


def rollout(engine: HFEngine, prompts: list[list[int]], new_tokens: int) -> tuple[dict, list]:
    sampling = SamplingConfig(1.0, 1.0, new_tokens)
    engine.generate(prompts[:2], SamplingConfig(1.0, 1.0, 2), seed=0)  # warm-up
    load_before = load()
    with Stopwatch() as sw:
        gens = engine.generate(prompts, sampling, seed=1)
    generated = sum(len(g.token_ids) for g in gens)
    prompt_tokens = sum(len(p) for p in prompts)
    return {
        "rows": len(prompts),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "wall_s": sw.wall_s,
        "cpu_s": sw.cpu_s,
        "generated_tokens_per_s": generated / sw.wall_s,
        "generated_tokens_per_cpu_s": generated / max(sw.cpu_s, 1e-9),
        "load": [load_before, load()],
    }, gens


def one_turn_episodes(prompts: list[list[int]], gens: list) -> list[Episode]:
    """Each reply a one-turn episode, in groups of two of which the first succeeds: every turn has a gradient."""
    return [
        make_episode(
            [make_turn(prompt_ids=p, action_ids=g.token_ids, behaviour_logprobs=g.logprobs, done=True)],
            task_id=i // 2,
            group_id=i // 2,
            rollout_index=i % 2,
            reward=float(i % 2 == 0),
            success=i % 2 == 0,
        )
        for i, (p, g) in enumerate(zip(prompts, gens, strict=True))
    ]


def update(model: str, episodes: list[Episode], threads: int, lora_rank: int) -> dict:
    from serl_cli.training.learner import Learner
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import LoraConfig, TrainConfig

    cfg = TrainConfig(
        algo="grpo",
        threads=threads,
        lora=LoraConfig(rank=lora_rank),
        optim=OptimConfig(lr=1e-5, micro_batch_tokens=MICRO_BATCH_TOKENS),
    )
    learner = Learner(model, cfg)
    set_torch_threads(threads)
    tokens = sum(len(t.prompt_ids) + len(t.action_ids) for e in episodes for t in e.turns)
    reply = sum(len(t.action_ids) for e in episodes for t in e.turns)
    load_before = load()
    with Stopwatch() as fwd:
        learner.recompute_logp_old(copy.deepcopy(episodes), 1.0)
    with Stopwatch() as sw:
        metrics = learner.update(copy.deepcopy(episodes), 1.0)
    assert metrics["turns_with_gradient"] == len(episodes) and metrics["optimizer_steps"] == 1
    del learner
    return {
        "lora_rank": lora_rank,
        "turns": len(episodes),
        "tokens": tokens,
        "reply_tokens": reply,
        "update_wall_s": sw.wall_s,
        "update_cpu_s": sw.cpu_s,
        "update_tokens_per_s": tokens / sw.wall_s,
        "update_tokens_per_cpu_s": tokens / max(sw.cpu_s, 1e-9),
        "update_reply_tokens_per_s": reply / sw.wall_s,
        "forward_wall_s": fwd.wall_s,
        "forward_cpu_s": fwd.cpu_s,
        "forward_over_update": fwd.cpu_s / max(sw.cpu_s, 1e-9),
        "load": [load_before, load()],
    }


def iteration(model: str, threads: int) -> dict:
    """One SERL iteration of the online loop at small sizes; its phases from timings.jsonl."""
    from serl_cli import api

    sets = [
        "train.algo=serl",
        "rollout.tasks=4",
        "rollout.group_size=2",
        "env.max_turns=3",
        "eval.episodes=0",
        "train.recompute_logp_old=true",
        f"train.threads={threads}",
    ]
    with tempfile.TemporaryDirectory(prefix="serl-real-model-") as tmp:
        cfg = api.load_config("train", [str(CONFIG)], sets)
        cfg.model, cfg.out = model, str(Path(tmp) / "run")
        load_before = load()
        with Stopwatch() as sw:
            (metrics,) = api.train_online(cfg)
        timing = json.loads((Path(cfg.out) / "timings.jsonl").read_text().splitlines()[-1])
    rank = timing["ranks"][0]
    annotate = timing["update"].get("annotate", {})
    phases = {
        "rollout_s": timing["rollout_s"],
        "pi_old_s": rank.get("recompute_s", 0.0),
        "teacher_forward_s": annotate.get("teacher_forward_s", 0.0),
        "annotate_rest_s": annotate.get("rest_s", 0.0),
        "update_s": timing["update"]["update_s"],
    }
    phases["checkpoint_and_rest_s"] = timing["iteration_s"] - sum(phases.values())
    return {
        "iteration_s": timing["iteration_s"],
        "process_wall_s": sw.wall_s,
        "process_cpu_s": sw.cpu_s,
        **phases,
        "teacher_over_update": phases["teacher_forward_s"] / max(phases["update_s"], 1e-9),
        "turns": metrics.get("turns"),
        "turns_with_gradient": metrics.get("turns_with_gradient"),
        "teacher_turns": metrics.get("teacher_turns_scored"),
        "checkpoint_bytes": timing["update"].get("checkpoint_bytes"),
        "load": [load_before, load()],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="serl model fetch smollm2-135m-instruct --out DIR")
    ap.add_argument("--threads", default="1,2", help="torch thread counts, comma-separated")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--no-iteration", action="store_true", help="skip the online iteration's phases")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    model, tokenizer = load_model(args.model)
    model.eval()
    engine = HFEngine(model, tokenizer)
    prompts = sokoban_prompts(tokenizer, args.rows)
    runs: list[dict] = []
    for n in threads:
        set_torch_threads(n)
        gen, gens = rollout(engine, prompts, args.new_tokens)
        episodes = one_turn_episodes(prompts, gens)
        updates = [update(args.model, episodes, n, rank) for rank in (0, 8)]
        runs.append({"threads": n, "rollout": gen, "updates": updates})
    online: dict[int, dict] = {} if args.no_iteration else {n: iteration(args.model, n) for n in threads}
    rows = [
        [
            r["threads"],
            "full" if u["lora_rank"] == 0 else f"LoRA {u['lora_rank']}",
            r["rollout"]["generated_tokens_per_s"],
            r["rollout"]["generated_tokens_per_cpu_s"],
            u["update_tokens_per_s"],
            u["update_tokens_per_cpu_s"],
            u["update_reply_tokens_per_s"],
            u["forward_over_update"],
        ]
        for r in runs
        for u in r["updates"]
    ]
    columns = [
        "threads",
        "update",
        "rollout tok/s",
        "rollout tok/CPU s",
        "update tok/s",
        "update tok/CPU s",
        "update reply tok/s",
        "fwd / update (CPU)",
    ]
    data = {"model": args.model, "rows": args.rows, "new_tokens": args.new_tokens, "runs": runs, "iterations": online}
    for n, phases in online.items():
        shown = ", ".join(f"{k} {v:.1f}" for k, v in phases.items() if k.endswith("_s"))
        print(f"one SERL iteration, {n} thread(s): {shown}")
    report("real_model", f"SmolLM2-135M-Instruct (dequantized Q4_1), {args.rows} rows", columns, rows, data, args.out)
    return data


if __name__ == "__main__":
    main()
