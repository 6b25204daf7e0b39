"""``serl eval``: run a policy over a split's fixed panel and summarize it.

The panel is ``episodes`` tasks of the split in its fixed order (all of them by default),
one episode each, so every machine and every run scores the same tasks: the first ones
(``panel: first``) or ones evenly spaced over the split (``panel: spread``).
Writes ``episodes.jsonl`` (one record per episode) and ``eval.json`` (the summary:
success with a 95 % Wilson interval, mean score, invalid-action rate, mean turns).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, get_args

from envs.base import TaskTyped
from serl_cli import config as cfgmod
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Episode
from serl_cli.config import at_least, setting
from serl_cli.errors import SerlError
from serl_cli.models.choices import Device, Dtype, check_names
from serl_cli.rollout.engines import EngineName, ModelPolicy, SamplingConfig, check_dispatch, check_engine
from serl_cli.rollout.engines.vllm import VLLMConfig
from serl_cli.rollout.policies import ExpertPolicy, RandomPolicy
from serl_cli.rollout.prompts import PromptConfig, trained_prompt
from serl_cli.rollout.runner import Dispatch, EpisodeSpec
from serl_cli.rollout.worlds import EnvConfig, build_world, built_split, world_info
from serl_cli.stages.rollout import collect

Policy = Literal["model", "expert", "random"]
POLICIES = get_args(Policy)

# Which `n` of a split's `total` tasks a panel scores. ALFWorld's splits are sorted by task
# type, so its first 10 games are all one type; `spread` takes every type in proportion.
PANELS = {
    "first": lambda n, total: list(range(n)),
    "spread": lambda n, total: [i * total // n for i in range(n)],
}
Panel = Literal["first", "spread"]


@dataclass
class EvalConfig:
    env: EnvConfig = setting(factory=EnvConfig, doc="the environment; split null: its evaluation split")
    policy: Policy = setting("expert", "model | expert | random; --model implies model")
    model: str | None = setting(None, "a Hugging Face model directory or name")
    episodes: int | None = setting(None, "how many tasks of the split's panel; null: the whole split")
    panel: Panel = setting("first", "which tasks: first (the first N) | spread (N evenly spaced)")
    seed: int = setting(0, "sampling (and the random policy)")
    batch_size: int = setting(64, "episodes live at once", limit=at_least(1, whole=True))
    env_workers: int = setting(
        1, "processes the environments step in (rollout.env_workers); same episodes", limit=at_least(1, whole=True)
    )
    dispatch: Dispatch = setting("round", "round | episode (rollout.dispatch): each episode's turns sent on alone")
    temperature: float = setting(
        0.0, "0: greedy decoding for model policies", limit=at_least(0, "0 (greedy) or positive")
    )
    coupled: bool = setting(False, "sampled: each episode's turns from their own stream (sampling.coupled)")
    prompt: PromptConfig | None = setting(
        None, "what a turn's prompt shows; null: what the checkpoint was trained with, else the defaults"
    )
    history_turns: int | None = setting(
        None, "K past turns in the prompt; null: the prompt's", limit=at_least(-1, "-1 (all), 0 or more", whole=True)
    )
    max_new_tokens: int = setting(48, "the reply's token budget", limit=at_least(1, whole=True))
    threads: int | None = setting(
        None,
        "torch threads for a model policy; null: all cores",
        limit=at_least(1, "at least 1 (or unset: every core)", whole=True),
    )
    engine: EngineName = setting(
        "hf", "a model policy generates with: hf | vllm (the vllm extra; settings: --set vllm.tensor_parallel_size=N)"
    )
    vllm: VLLMConfig = setting(factory=VLLMConfig, doc="engine vllm: tensor parallelism, memory, dtype")
    gpus: list[int] | None = setting(None, "engine vllm: its CUDA devices (one per shard); null: vLLM's choice")
    device: Device = setting("auto", "engine hf: auto (CUDA when present) | cpu | cuda")
    dtype: Dtype = setting(
        "auto", "auto (bf16 on a GPU with it, else fp32) | fp32 | bf16 | fp16: compute precision, through autocast"
    )
    out: str = setting("runs/eval", "output directory (eval.json, episodes.jsonl)")


def summarize(records: list[Episode], task_types: list[str | None] | None = None) -> dict:
    """The panel's figures; with ``task_types`` (one per record: ALFWorld's) also per task type."""
    from serl_cli.stats.summary import wilson_interval  # scipy: when a run is summarized, not when a config loads

    n = len(records)
    wins = sum(r.success for r in records)
    turns = sum(r.num_turns for r in records)
    summary = {
        "episodes": n,
        "success_rate": wins / n if n else 0.0,
        "success_ci95": wilson_interval(wins, n),
        "score": 100.0 * sum(r.reward for r in records) / n if n else 0.0,
        "invalid_action_rate": sum(r.invalid_actions for r in records) / turns if turns else 0.0,
        "mean_turns": turns / n if n else 0.0,
    }
    if task_types:
        groups: dict[str, list[Episode]] = {}
        for r, kind in zip(records, task_types, strict=True):
            groups.setdefault(kind or "unknown", []).append(r)
        summary["by_task_type"] = {k: summarize(v) for k, v in sorted(groups.items())}
    return summary


def eval_prompt(cfg: EvalConfig) -> PromptConfig:
    """How a model is prompted: ``cfg.prompt``; else as the checkpoint was trained (its
    serl_prompt.json), else the defaults; ``history_turns`` (when set) overrides K."""
    prompt = copy.deepcopy(cfg.prompt) if cfg.prompt is not None else trained_prompt(cfg.model) or PromptConfig()
    if cfg.history_turns is not None:
        prompt.history_turns = cfg.history_turns
    return prompt


def eval_sampling(cfg: EvalConfig) -> SamplingConfig:
    """Greedy (temperature 0) or at ``cfg.temperature`` with top_p 1, in the token budget, coupled or not."""
    return SamplingConfig(cfg.temperature, 1.0, cfg.max_new_tokens, cfg.coupled)


def model_eval_policy(cfg: EvalConfig, engine) -> ModelPolicy:
    """The model policy an evaluation runs on ``engine``: the online loop's periodic one (its
    engine serves the updated policy) and ``serl eval --model`` alike."""
    return ModelPolicy(engine, eval_sampling(cfg), eval_prompt(cfg), seed=cfg.seed)


def make_policy(cfg: EvalConfig):
    if cfg.policy not in POLICIES:
        raise SerlError(f"unknown policy {cfg.policy!r}: choose one of {', '.join(POLICIES)}")
    if cfg.policy == "expert":
        return ExpertPolicy()
    if cfg.policy == "random":
        return RandomPolicy(cfg.seed)
    from serl_cli.rollout.engines import model_engine  # torch and transformers load only when a model is used

    if not cfg.model:
        raise SerlError("policy 'model' needs --model DIR (a Hugging Face model directory or name)")
    cfg.history_turns = eval_prompt(cfg).history_turns  # recorded in eval_config.yaml
    engine = model_engine(
        cfg.model,
        seed=cfg.seed,
        threads=cfg.threads,
        engine=cfg.engine,
        device=cfg.device,
        dtype=cfg.dtype,
        vllm=cfg.vllm,
        gpus=cfg.gpus,
    )
    return model_eval_policy(cfg, engine)


def check_model_settings(cfg: EvalConfig) -> None:
    """An unknown engine, vLLM without its extra, bad device/dtype words: before anything loads."""
    check_names(cfg.device, cfg.dtype)
    check_engine(cfg.engine)


def check_eval_config(cfg: EvalConfig) -> None:
    """The evaluation's numbers, each a value it can take: refused in one line before anything loads."""
    cfgmod.check_limits(cfg)  # the declared limits (setting(..., limit=...))
    check_dispatch(cfg.dispatch, cfg.policy, cfg.engine, cfg.temperature, cfg.coupled)


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
    specs = panel_specs(cfg, world)
    policy = policy or make_policy(cfg)
    started = time.time()
    try:
        records = collect(cfg, world, specs, policy, progress)
    finally:
        if own:
            from serl_cli.rollout.engines import close_engine

            close_engine(policy.engine)
    return write_eval(cfg, world, records, time.time() - started)


def panel_specs(cfg: EvalConfig, world) -> list[EpisodeSpec]:
    """The panel's episodes: ``cfg.episodes`` tasks of the split (all by default), one each. Each is its own
    group, keyed by its task, so under coupled sampling every room draws from its own stream (the same in every
    evaluation with the seed, whatever the panel's order), not all from group 0's."""
    total = world.num_tasks(cfg.env.split)
    n = total if cfg.episodes is None else cfg.episodes
    if not 0 < n <= total:
        raise SerlError(f"--episodes {n} out of range: the {cfg.env.name} {cfg.env.split} panel has {total} tasks")
    return [EpisodeSpec(task_id=i, group_id=i) for i in PANELS[cfg.panel](n, total)]


def write_eval(cfg: EvalConfig, world, records: list[Episode], wall: float) -> dict:
    """The panel's records, summarized, into ``cfg.out``: ``episodes.jsonl`` and ``eval.json``."""
    out = Path(cfg.out)
    task_types: list[str | None] | None = None
    if isinstance(world, TaskTyped):  # ALFWorld: success by task type in eval.json
        task_types = [world.task_type(built_split(cfg.env), r.task_id) for r in records]
    summary = {
        "env": cfg.env.name,
        "split": cfg.env.split,
        "policy": cfg.policy,
        "model": cfg.model,
        "panel": cfg.panel,
        "environment": world_info(world),  # e.g. which WebShop catalog ran: the real 1k or serl's synthetic
        **summarize(records, task_types),
        "wall_time_s": round(wall, 3),
    }
    rows = [_episode_row(r, None if task_types is None else task_types[i]) for i, r in enumerate(records)]
    io.write_jsonl(out / "episodes.jsonl", rows)
    io.write_json(out / "eval.json", summary)
    return summary


def _episode_row(rec: Episode, task_type: str | None) -> dict:
    """One line of ``episodes.jsonl``; ``task_type``: the environment's name for the task's kind, where it has one."""
    keep = ("task_id", "instruction", "reward", "success", "num_turns", "invalid_actions", "truncated")
    row = {k: getattr(rec, k) for k in keep}
    if task_type is not None:
        row["task_type"] = task_type
    return {**row, "actions": [t.action for t in rec.turns]}
