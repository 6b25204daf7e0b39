"""``serl rollout``: run a policy on sampled tasks, G times each, and store every turn.

Tasks are drawn from the split with ``random.Random(seed)`` (without replacement); each
task is run ``group_size`` times (its group). A model policy samples with the run's seed,
so the same command twice gives byte-identical ``rollouts.jsonl`` on CPU. The expert
policy records SFT data: the same prompt ids a model would see and the expert's action as
the reply, tokenized with ``--model``'s tokenizer (or the default model's).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from serl_cli import io
from serl_cli.engines import ModelPolicy, SamplingConfig, TokenizedExpertPolicy, make_engine
from serl_cli.errors import SerlError
from serl_cli.prompts import PromptConfig
from serl_cli.runner import EpisodeSpec, run_episodes
from serl_cli.schema import ROLLOUTS_FILE
from serl_cli.settings import EnvConfig, build_world

POLICIES = ("model", "expert")


@dataclass
class RolloutConfig:
    env: EnvConfig = field(default_factory=lambda: EnvConfig(split="train"))
    model: str | None = None  # None: the embedded default tiny model for the environment
    policy: str = "model"  # model | expert (SFT data)
    engine: str = "hf"
    tasks: int = 8  # how many tasks to sample from the split
    group_size: int = 8  # G rollouts per task
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    batch_size: int = 64  # episodes live at once (one generate call per turn across them)
    seed: int = 0
    threads: int | None = None  # torch threads; None = all cores
    out: str = "runs/rollout"


def sample_tasks(num_tasks: int, count: int, seed: int) -> list[int]:
    if not 0 < count <= num_tasks:
        raise SerlError(f"--tasks {count} out of range: the split has {num_tasks} tasks")
    return random.Random(seed).sample(range(num_tasks), count)


def episode_specs(task_ids: list[int], group_size: int) -> list[EpisodeSpec]:
    if group_size < 1:
        raise SerlError(f"--group-size must be at least 1, got {group_size}")
    return [EpisodeSpec(task_id=t, group_id=g, rollout_index=r) for g, t in enumerate(task_ids) for r in range(group_size)]


def resolve_model(cfg: RolloutConfig, world) -> str:
    if cfg.model:
        return cfg.model
    from serl_cli.default_model import default_model_dir

    return str(default_model_dir(world, cfg.env.name))


def make_rollout_policy(cfg: RolloutConfig, model, tokenizer):
    if cfg.policy == "expert":
        return TokenizedExpertPolicy(tokenizer, cfg.prompt)
    if cfg.policy == "model":
        return ModelPolicy(make_engine(cfg.engine, model, tokenizer), cfg.sampling, cfg.prompt, seed=cfg.seed)
    raise SerlError(f"unknown rollout policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")


def run_rollout(cfg: RolloutConfig, *, overwrite: bool = False, progress=None, model=None, tokenizer=None) -> dict:
    """Collect rollouts into ``cfg.out``; returns a summary. ``model``/``tokenizer`` may be
    passed in (the online loop keeps its policy in memory)."""
    from serl_cli.model import load_model, set_torch_threads

    out = Path(cfg.out)
    io.prepare_output(out / ROLLOUTS_FILE, overwrite=overwrite, what="rollouts")
    if cfg.policy not in POLICIES:
        raise SerlError(f"unknown rollout policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")
    world = build_world(cfg.env)
    task_ids = sample_tasks(world.num_tasks(cfg.env.split), cfg.tasks, cfg.seed)
    specs = episode_specs(task_ids, cfg.group_size)
    set_torch_threads(cfg.threads)
    if model is None:
        cfg.model = resolve_model(cfg, world)
        model, tokenizer = load_model(cfg.model)
    model.eval()
    policy = make_rollout_policy(cfg, model, tokenizer)
    manifest = io.new_manifest("rollout", io.to_plain(cfg), cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    io.write_json(out / "manifest.json", manifest)
    started = time.time()
    records = run_episodes(world, cfg.env.split, specs, policy, max_turns=cfg.env.max_turns,
                           batch_size=cfg.batch_size, on_episode_done=progress)
    wall = time.time() - started
    io.write_jsonl(out / ROLLOUTS_FILE, records)
    gen_tokens = sum(len(t["action_ids"]) for r in records for t in r["turns"])
    turns = sum(r["num_turns"] for r in records)
    summary = {
        "episodes": len(records),
        "tasks": len(task_ids),
        "turns": turns,
        "mean_reward": sum(r["reward"] for r in records) / len(records),
        "success_rate": sum(r["success"] for r in records) / len(records),
        "invalid_action_rate": sum(r["invalid_actions"] for r in records) / max(turns, 1),
        "generated_tokens": gen_tokens,
        "wall_time_s": round(wall, 3),
        "tokens_per_s": gen_tokens / wall if wall > 0 else 0.0,
        "turns_per_s": turns / wall if wall > 0 else 0.0,
    }
    io.mark_stage(out, "rollout", "done", summary=summary)
    return summary
