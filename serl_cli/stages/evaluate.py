"""``serl eval``: run a policy over a split's fixed panel and summarize it.

The panel is ``episodes`` tasks of the split in its fixed order (all of them by default),
one episode each, so every machine and every run scores the same tasks: the first ones
(``panel: first``) or ones evenly spaced over the split (``panel: spread``).
Writes ``episodes.jsonl`` (one record per episode) and ``eval.json`` (the summary:
success with a 95 % Wilson interval, mean score, invalid-action rate, mean turns).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.rollout.engines.vllm import VLLMConfig
from serl_cli.rollout.policies import ExpertPolicy, RandomPolicy
from serl_cli.rollout.runner import EpisodeSpec, run_episodes
from serl_cli.rollout.worlds import EnvConfig, build_world, world_info
from serl_cli.stats.summary import wilson_interval

POLICIES = ("model", "expert", "random")

# Which `n` of a split's `total` tasks a panel scores. ALFWorld's splits are sorted by task
# type, so its first 10 games are all one type; `spread` takes every type in proportion.
PANELS = {
    "first": lambda n, total: list(range(n)),
    "spread": lambda n, total: [i * total // n for i in range(n)],
}


@dataclass
class EvalConfig:
    env: EnvConfig = field(default_factory=EnvConfig)
    policy: str = "expert"  # model | expert | random; `--model` implies model
    model: str | None = None
    episodes: int | None = None  # None: the whole split
    panel: str = "first"  # first | spread: which tasks of the split (PANELS)
    seed: int = 0
    batch_size: int = 64
    temperature: float = 0.0  # 0 = greedy decoding for model policies
    coupled: bool = False  # sampled: each episode's turns from their own stream (SamplingConfig.coupled)
    history_turns: int | None = None  # None: what the checkpoint was trained with, else 2
    max_new_tokens: int = 48
    threads: int | None = None
    engine: str = "hf"  # hf | vllm: what a model policy generates with
    vllm: VLLMConfig = field(default_factory=VLLMConfig)  # engine vllm: tensor parallelism, memory, dtype
    gpus: list[int] | None = None  # engine vllm: its CUDA devices (one per shard); None: vLLM's choice
    device: str = "auto"  # engine hf: auto (CUDA when present) | cpu | cuda
    dtype: str = "auto"  # engine hf: auto (bf16 on a GPU with it, else fp32) | fp32 | bf16 | fp16 (autocast)
    out: str = "runs/eval"


def summarize(records: list[dict], by: str | None = None) -> dict:
    n = len(records)
    wins = sum(r["success"] for r in records)
    turns = sum(r["num_turns"] for r in records)
    summary = {
        "episodes": n,
        "success_rate": wins / n if n else 0.0,
        "success_ci95": wilson_interval(wins, n),
        "score": 100.0 * sum(r["reward"] for r in records) / n if n else 0.0,
        "invalid_action_rate": sum(r["invalid_actions"] for r in records) / turns if turns else 0.0,
        "mean_turns": turns / n if n else 0.0,
    }
    if by:
        groups: dict[str, list[dict]] = {}
        for r in records:
            groups.setdefault(r.get(by) or "unknown", []).append(r)
        summary[f"by_{by}"] = {k: summarize(v) for k, v in sorted(groups.items())}
    return summary


def make_policy(cfg: EvalConfig):
    if cfg.policy not in POLICIES:
        raise SerlError(f"unknown policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")
    if cfg.policy == "expert":
        return ExpertPolicy()
    if cfg.policy == "random":
        return RandomPolicy(cfg.seed)
    from serl_cli.rollout.engines import model_policy  # torch and transformers load only when a model is used
    from serl_cli.rollout.prompts import PromptConfig, trained_prompt

    prompt = trained_prompt(cfg.model) or PromptConfig()  # prompt the model as it was trained
    if cfg.history_turns is not None:
        prompt.history_turns = cfg.history_turns
    cfg.history_turns = prompt.history_turns  # recorded in eval_config.yaml
    return model_policy(
        cfg.model,
        temperature=cfg.temperature,
        seed=cfg.seed,
        prompt=prompt,
        max_new_tokens=cfg.max_new_tokens,
        threads=cfg.threads,
        engine=cfg.engine,
        device=cfg.device,
        dtype=cfg.dtype,
        vllm=cfg.vllm,
        gpus=cfg.gpus,
        coupled=cfg.coupled,
    )


def check_model_settings(cfg: EvalConfig) -> None:
    """An unknown engine, vLLM without its extra, bad device/dtype words: before anything loads."""
    from serl_cli.models.device import check_names
    from serl_cli.rollout.engines import check_engine

    check_names(cfg.device, cfg.dtype)
    check_engine(cfg.engine)


def check_eval_config(cfg: EvalConfig) -> None:
    """The evaluation's numbers, each a value it can take: refused in one line before anything loads."""
    if not (math.isfinite(cfg.temperature) and cfg.temperature >= 0):
        raise SerlError(f"temperature must be 0 (greedy) or positive, got {cfg.temperature}")
    for name in ("batch_size", "max_new_tokens"):
        if getattr(cfg, name) < 1:
            raise SerlError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    if cfg.threads is not None and cfg.threads < 1:
        raise SerlError(f"threads must be at least 1 (or unset: every core), got {cfg.threads}")
    if cfg.history_turns is not None and cfg.history_turns < -1:
        raise SerlError(f"history_turns must be -1 (all), 0 or more, got {cfg.history_turns}")


def run_eval(cfg: EvalConfig, *, overwrite: bool = False, progress=None, policy=None) -> dict:
    """Evaluate and write ``eval.json``; ``policy`` may be passed in (the online loop's in-memory model)."""
    if cfg.model and cfg.policy == "expert":
        cfg.policy = "model"
    if cfg.policy == "model" and not cfg.model and policy is None:
        raise SerlError("policy 'model' needs --model DIR (a Hugging Face model directory or name)")
    if cfg.panel not in PANELS:
        raise SerlError(f"unknown panel {cfg.panel!r}: choose one of {', '.join(PANELS)}")
    check_eval_config(cfg)
    own = policy is None and cfg.policy == "model"  # an engine this call starts, and closes
    if own:
        check_model_settings(cfg)
    out = Path(cfg.out)
    io.prepare_output(out / "eval.json", overwrite=overwrite, what="an evaluation")
    world = build_world(cfg.env)
    total = world.num_tasks(cfg.env.split)
    n = total if cfg.episodes is None else cfg.episodes
    if not 0 < n <= total:
        raise SerlError(f"--episodes {n} out of range: the {cfg.env.name} {cfg.env.split} panel has {total} tasks")
    policy = policy or make_policy(cfg)
    started = time.time()
    task_ids = PANELS[cfg.panel](n, total)
    try:
        records = run_episodes(
            world,
            cfg.env.split,
            [EpisodeSpec(task_id=i) for i in task_ids],
            policy,
            max_turns=cfg.env.max_turns,
            batch_size=cfg.batch_size,
            on_episode_done=progress,
            step_timeout_s=cfg.env.step_timeout_s,
        )
    finally:
        if own:
            from serl_cli.rollout.engines import close_engine

            close_engine(policy.engine)
    if hasattr(world, "task_type"):  # ALFWorld: success by task type in eval.json
        for r in records:
            r["task_type"] = world.task_type(cfg.env.split, r["task_id"])
    summary = {
        "env": cfg.env.name,
        "split": cfg.env.split,
        "policy": cfg.policy,
        "model": cfg.model,
        "panel": cfg.panel,
        "environment": world_info(world),  # e.g. which WebShop catalog ran: the real 1k or serl's synthetic
        **summarize(records, by="task_type" if records and "task_type" in records[0] else None),
        "wall_time_s": round(time.time() - started, 3),
    }
    io.write_jsonl(out / "episodes.jsonl", [_episode_row(r) for r in records])
    io.write_json(out / "eval.json", summary)
    return summary


def _episode_row(rec: dict) -> dict:
    keep = ("task_id", "instruction", "reward", "success", "num_turns", "invalid_actions", "truncated", "task_type")
    row = {k: rec[k] for k in keep if k in rec}
    row["actions"] = [t["action"] for t in rec["turns"]]
    return row
