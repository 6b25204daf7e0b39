"""How close a serl update runs to this machine's limit: training FLOP/s against the fp32 matmul peak.

    python -m benchmarks.flops [--preset small|tiny] [--tasks 2] [--group-size 4] [--max-turns 6]
                               [--max-new-tokens 24] [--threads 1] [--repeats 2] [--out FILE]

Training FLOP/s = 6 x N x tokens/s (Kaplan et al. 2020, "Scaling laws for neural language
models", sec. 2.1: C ~ 6N per training token, forward 2N + backward 4N). N counts the
*non-embedding* parameters, as Kaplan and nanoGPT's MFU estimate do: the embedding lookup
costs no multiply-adds, and serl runs the tied LM head only on the action positions
(``logits_to_keep``), so charging the embedding matrix to every prompt token would credit
work that is never done. tokens/s counts the real (unpadded) prompt + action tokens of
every turn that went through the gradient step, over the CPU time of the whole
``Learner.update`` call (``benchmarks.common.Stopwatch``: the machine is shared, and CPU
time leaves out the time the process waited for a core); padding is work done but not counted. The JSON adds the terms
6N leaves out, counted the same way: the attention score and mix matmuls (12 x layers x
d_model x sequence length per token, Chowdhery et al. 2022, PaLM, app. B) and the LM head
on the action positions (6 x vocab x d_model per kept position).

The peak: the best rate (per CPU second) of a square fp32 ``torch.mm`` (2 n^3 FLOPs) over
a few sizes, measured in the same process on the same thread count right before and right after the
training measurement; the higher of the two is the peak (the ratio errs low, not high).

The batch: the preset's own model (the embedded default for WebShop, built and cached on
first use) samples ``--tasks`` x G episodes on the train split; rewards are the
synthetic ones of ``benchmarks.train_step`` (half of every group succeeds, so every turn
carries a gradient). One untimed warm-up update, then ``--repeats`` timed GRPO updates
with serl's default settings (one optimizer step, 16384 padded tokens per micro-batch);
the fastest is kept. Target: >= 30 % of peak on the small preset.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from benchmarks.common import Stopwatch, report
from benchmarks.train_step import Batch, UpdateBench, make_batch
from serl_cli.artifacts.schema import TurnSample, turn_samples
from serl_cli.errors import SerlError
from serl_cli.training.learner import Learner
from serl_cli.training.train_config import TrainConfig


@dataclass
class FlopsBench:
    preset: str = "small"
    tasks: int = 2
    group_size: int = 4
    max_turns: int = 6
    max_new_tokens: int = 24
    threads: int = 1
    seed: int = 0
    repeats: int = 2
    matmul_sizes: tuple[int, ...] = (1024, 2048, 4096)
    catalog: str = "auto"


# -- the machine's limit -----------------------------------------------------------------------
def matmul_flops(n: int, seconds: float) -> float:
    """FLOP/s of an n x n by n x n matmul that took ``seconds``: n^3 multiply-adds."""
    return 2.0 * n**3 / seconds


def matmul_peak(sizes: tuple[int, ...], repeats: int = 3) -> dict:
    """Best fp32 ``torch.mm`` rate (per CPU second) over ``sizes``, each run ``repeats`` times
    after one untimed call."""
    best = {}
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        c = torch.empty(n, n)
        torch.mm(a, b, out=c)
        fastest = float("inf")
        for _ in range(repeats):
            with Stopwatch() as watch:
                torch.mm(a, b, out=c)
            fastest = min(fastest, watch.cpu_s)
        best[n] = matmul_flops(n, fastest)
    return {"flops": max(best.values()), "by_size": best, "threads": torch.get_num_threads()}


# -- what a step computes ------------------------------------------------------------------------
def non_embedding_parameters(model) -> int:
    """Unique parameters minus the input embedding matrix (tied to the LM head here)."""
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    return total - emb.numel()


def step_flops(samples: list[TurnSample], n_params: int, layers: int, d_model: int, vocab: int) -> dict:
    """Training FLOPs of one pass over ``samples`` (forward + backward = 3 x forward).

    ``six_n``: 6 N per real token. ``attention``: per token, 2 matmuls (scores, mix) of
    2 x d_model x T multiply-adds each per layer, x3 for training = 12 L d T (PaLM app. B).
    ``lm_head``: 6 x vocab x d_model per action token (the positions whose logits are kept).
    """
    tokens = [len(s.prompt_ids) + len(s.action_ids) for s in samples]
    action = sum(len(s.action_ids) for s in samples)
    return {
        "tokens": sum(tokens),
        "action_tokens": action,
        "six_n": 6.0 * n_params * sum(tokens),
        "attention": float(sum(12 * layers * d_model * t * t for t in tokens)),
        "lm_head": 6.0 * vocab * d_model * action,
    }


def preset_model(preset: str, world) -> str:
    from serl_cli.rollout.default_model import default_model_dir

    return str(default_model_dir(world, "webshop", preset=preset))


def measure(cfg: FlopsBench, log=print) -> dict:
    from serl_cli.models.loading import set_torch_threads
    from serl_cli.rollout.worlds import EnvConfig, build_world

    set_torch_threads(cfg.threads)
    world = build_world(
        EnvConfig(name="webshop", split="train", max_turns=cfg.max_turns, settings={"catalog": cfg.catalog})
    )
    t0 = time.perf_counter()
    model_name = preset_model(cfg.preset, world)
    log(f"{cfg.preset} model ready in {time.perf_counter() - t0:.1f} s: {model_name}")
    batch: Batch = make_batch(
        UpdateBench(
            catalog=cfg.catalog,
            model=model_name,
            tasks=cfg.tasks,
            group_size=cfg.group_size,
            max_turns=cfg.max_turns,
            max_new_tokens=cfg.max_new_tokens,
            threads=cfg.threads,
            seed=cfg.seed,
        )
    )
    log(f"rollouts: {len(batch.episodes)} episodes, {batch.turns} turns in {batch.rollout_s:.1f} s")
    peak_before = matmul_peak(cfg.matmul_sizes)
    learner = Learner(model_name, TrainConfig(algo="grpo", seed=cfg.seed, threads=cfg.threads))
    mc = learner.model.config
    n_params = non_embedding_parameters(learner.model)
    learner.update(batch.episodes, 1.0)  # warm-up: lazy setup, heap growth, the AdamW state
    watches, grad_turns = [], None
    for _ in range(cfg.repeats):
        with Stopwatch() as watch:
            metrics = learner.update(batch.episodes, 1.0)
        watches.append(watch)
        grad_turns = metrics["turns_with_gradient"]
    peak_after = matmul_peak(cfg.matmul_sizes)
    samples = turn_samples(batch.episodes)
    if grad_turns != len(samples):
        raise SerlError(f"only {grad_turns} of {len(samples)} turns had a gradient: the token count would be wrong")
    flops = step_flops(samples, n_params, mc.num_hidden_layers, mc.hidden_size, mc.vocab_size)
    cpu = min(w.cpu_s for w in watches)
    peak = max(peak_before["flops"], peak_after["flops"])
    train = flops["six_n"] / cpu
    with_attention = (flops["six_n"] + flops["attention"] + flops["lm_head"]) / cpu
    return {
        "preset": cfg.preset,
        "model": model_name,
        "threads": cfg.threads,
        "non_embedding_parameters": n_params,
        "parameters": sum(p.numel() for p in learner.model.parameters()),
        "turns": len(samples),
        "tokens": flops["tokens"],
        "action_tokens": flops["action_tokens"],
        "update_cpu_s": cpu,
        "all_update_cpu_s": [w.cpu_s for w in watches],
        "all_update_wall_s": [w.wall_s for w in watches],
        "tokens_per_s": flops["tokens"] / cpu,
        "step_flops": flops,
        "train_flops_per_s": train,
        "train_flops_per_s_with_attention_and_head": with_attention,
        "matmul_peak_flops_per_s": peak,
        "matmul_peak_before": peak_before,
        "matmul_peak_after": peak_after,
        "fraction_of_peak": train / peak,
        "fraction_of_peak_with_attention_and_head": with_attention / peak,
    }


def main() -> None:
    d = FlopsBench()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default=d.preset, choices=["tiny", "small"])
    ap.add_argument("--catalog", default=d.catalog, choices=["auto", "real", "synthetic"])
    ap.add_argument("--tasks", type=int, default=d.tasks)
    ap.add_argument("--group-size", type=int, default=d.group_size)
    ap.add_argument("--max-turns", type=int, default=d.max_turns)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--repeats", type=int, default=d.repeats)
    ap.add_argument("--out", default=None)
    args = vars(ap.parse_args())
    out = args.pop("out")
    try:
        data = measure(FlopsBench(**args))
    except SerlError as e:
        ap.exit(2, f"error: {e}\n")
    g = 1e9
    rows = [
        ["training (6N)", data["train_flops_per_s"] / g, data["fraction_of_peak"]],
        [
            "training (6N + attention + LM head)",
            data["train_flops_per_s_with_attention_and_head"] / g,
            data["fraction_of_peak_with_attention_and_head"],
        ],
        ["fp32 matmul peak", data["matmul_peak_flops_per_s"] / g, 1.0],
    ]
    report(
        "flops",
        f"Training FLOP/s, {data['preset']} preset ({data['non_embedding_parameters'] / 1e6:.1f}M "
        f"non-embedding params, {data['tokens']} tokens in {data['update_cpu_s']:.1f} CPU s, "
        f"{data['threads']} thread(s))",
        ["what", "GFLOP/s", "of peak"],
        rows,
        data,
        out,
    )


if __name__ == "__main__":
    main()
