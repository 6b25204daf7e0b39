"""Rollout throughput: serl's batched rollout against a one-prompt-at-a-time loop.

    python -m benchmarks.rollout [--catalog auto|real|synthetic] [--tasks 2] [--group-size 8]
                                 [--max-turns 15] [--max-new-tokens 32] [--threads 1]
                                 [--model DIR] [--seed 0] [--repeats 2] [--out FILE]

Both variants run the same episodes (``--tasks`` train tasks x ``--group-size`` G, 16 by
default) on the same model, prompts, sampling settings (temperature 1.0, full
distribution), ``--max-new-tokens`` and turn cap, through ``run_episodes`` with a
``ModelPolicy``. The only difference is the engine:

* batched: ``HFEngine`` as serl uses it -- one ``generate`` call per turn across every
  live episode (left-padded, one shared KV cache);
* per-episode: a wrapper engine that calls ``HFEngine.generate`` once per prompt, i.e.
  one ``model.generate`` per episode per turn.

Rates are computed from what was counted (generated tokens kept, up to and including the
end-of-turn token; environment turns taken), not assumed: the two variants sample
different tokens, so an episode may end early in one and not the other. With the
randomly initialised default model nearly every episode runs to the turn cap.

Runs on ``--threads`` torch threads, 1 by default: the machine is shared, and one thread
gives stable ratios. One untimed warm-up ``generate`` runs first; then the two variants run
``--repeats`` times, interleaved, and each variant's fastest repeat is reported (all wall
times go to the JSON). Every repeat runs the same episodes: same seed, same tokens. The default model is the
embedded tiny model for WebShop (built and cached on first use, see
``serl_cli.default_model``).
"""

from __future__ import annotations

import argparse
import time

from benchmarks.common import report
from serl_cli.engines import Generation, ModelPolicy, SamplingConfig
from serl_cli.engines.hf import HFEngine
from serl_cli.prompts import PromptConfig
from serl_cli.rollout import episode_specs, sample_tasks
from serl_cli.runner import run_episodes
from serl_cli.settings import EnvConfig, build_world


class CountingEngine:
    """An engine that counts its ``model.generate`` calls."""

    def __init__(self, engine: HFEngine):
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.generate_calls = 0

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        self.generate_calls += 1
        return self.engine.generate(prompts, sampling, seed)


class PerEpisodeEngine(CountingEngine):
    """The per-episode baseline: ``HFEngine.generate`` on one prompt at a time.

    Each prompt gets its own seed derived from the call's seed, so no two prompts (in this
    call or another) share a sampling stream."""

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        out = []
        for i, p in enumerate(prompts):
            self.generate_calls += 1
            out += self.engine.generate([p], sampling, seed * 1_000_003 + i)
        return out


def run_variant(name: str, engine: CountingEngine, world, specs, sampling: SamplingConfig, prompt: PromptConfig,
                seed: int, max_turns: int) -> dict:
    policy = ModelPolicy(engine, sampling, prompt, seed=seed)
    t0 = time.perf_counter()
    records = run_episodes(world, "train", specs, policy, max_turns=max_turns, batch_size=len(specs))
    wall = time.perf_counter() - t0
    turns = sum(r["num_turns"] for r in records)
    tokens = sum(len(t["action_ids"]) for r in records for t in r["turns"])
    return {
        "variant": name,
        "episodes": len(records),
        "turns": turns,
        "generated_tokens": tokens,
        "generate_calls": engine.generate_calls,
        "wall_s": wall,
        "tokens_per_s": tokens / wall,
        "turns_per_s": turns / wall,
        "episodes_at_turn_cap": sum(r["num_turns"] >= max_turns for r in records),
        "mean_reward": sum(r["reward"] for r in records) / len(records),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--catalog", default="auto", choices=["auto", "real", "synthetic"])
    ap.add_argument("--model", default=None, help="model directory or hub name (default: the embedded tiny model)")
    ap.add_argument("--tasks", type=int, default=2, help="train tasks to sample")
    ap.add_argument("--group-size", type=int, default=8, help="episodes per task (G)")
    ap.add_argument("--max-turns", type=int, default=15)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2, help="interleaved runs of each variant; the fastest is kept")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from serl_cli.model import load_model, set_torch_threads

    set_torch_threads(args.threads)
    world = build_world(EnvConfig(name="webshop", split="train", max_turns=args.max_turns,
                                  settings={"catalog": args.catalog}))
    if args.model:
        model_name = args.model
    else:
        from serl_cli.default_model import default_model_dir

        model_name = str(default_model_dir(world, "webshop"))
    model, tokenizer = load_model(model_name)
    model.eval()
    hf = HFEngine(model, tokenizer)
    sampling = SamplingConfig(temperature=args.temperature, top_p=1.0, max_new_tokens=args.max_new_tokens)
    prompt = PromptConfig()
    task_ids = sample_tasks(world.num_tasks("train"), args.tasks, args.seed)
    specs = episode_specs(task_ids, args.group_size)

    # warm up, untimed: the first generate pays lazy setup, the first search numpy/bm25s
    # setup, the first purchase the spaCy load (see benchmarks.env_webshop)
    world.engine.search("warm up")
    from envs.webshop.reward import title_nouns

    title_nouns("warm up the tagger")
    hf.generate([tokenizer.encode("warm up", add_special_tokens=False)] * 2, sampling, seed=args.seed)

    # Interleave the variants and keep each one's fastest repeat: the machine is shared, and
    # the fastest run is the one least disturbed by other load. Same seed, so every repeat
    # of a variant runs exactly the same episodes and tokens (CPU sampling is deterministic).
    runs: dict[str, list[dict]] = {"batched": [], "per-episode": []}
    for _ in range(args.repeats):
        runs["batched"].append(run_variant("batched", CountingEngine(hf), world, specs, sampling, prompt,
                                           args.seed, args.max_turns))
        runs["per-episode"].append(run_variant("per-episode", PerEpisodeEngine(hf), world, specs, sampling, prompt,
                                               args.seed, args.max_turns))
    results = []
    for rs in runs.values():
        best = dict(min(rs, key=lambda r: r["wall_s"]))
        best["all_wall_s"] = [r["wall_s"] for r in rs]
        results.append(best)
    b, p = results
    ratio = {"tokens_per_s": b["tokens_per_s"] / p["tokens_per_s"], "turns_per_s": b["turns_per_s"] / p["turns_per_s"]}
    rows = [[r["variant"], r["episodes"], r["turns"], r["generated_tokens"], r["wall_s"], r["tokens_per_s"],
             r["turns_per_s"]] for r in results]
    rows.append(["ratio", "", "", "", "", ratio["tokens_per_s"], ratio["turns_per_s"]])
    source = world.catalog.source.split(":")[0]
    report("rollout",
           f"Rollout throughput (WebShop {source}, train, {len(specs)} episodes = {args.tasks} x G={args.group_size}, "
           f"T={args.temperature}, max_new_tokens {args.max_new_tokens}, max_turns {args.max_turns}, "
           f"{args.threads} thread(s), best of {args.repeats})",
           ["variant", "episodes", "turns", "generated tokens", "wall s", "tokens/s", "turns/s"], rows,
           {"catalog": world.catalog.source, "model": model_name,
            "split": "train", "task_ids": task_ids, "group_size": args.group_size, "episodes": len(specs),
            "temperature": args.temperature, "top_p": 1.0, "max_new_tokens": args.max_new_tokens,
            "max_turns": args.max_turns, "threads": args.threads, "seed": args.seed, "repeats": args.repeats,
            "variants": results, "ratio_batched_over_per_episode": ratio}, args.out)
    print(f"batched/per-episode: tokens/s x{ratio['tokens_per_s']:.2f}, turns/s x{ratio['turns_per_s']:.2f}")


if __name__ == "__main__":
    main()
