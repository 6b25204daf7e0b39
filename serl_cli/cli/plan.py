"""``serl plan CONFIG``: memory per GPU item by item and phase by phase, the disk per checkpoint
and per run, and whether it fits; for a vLLM run its split and colocated layouts compared, with
an estimate of an iteration's time on each (``training.iteration_time``: arithmetic from stated
assumptions, not a measurement); ``--json``: the same as one JSON object on stdout."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace

import typer
from rich.table import Table

from serl_cli.cli.common import resolve
from serl_cli.cli.root import SetOpt, app, console, err_console
from serl_cli.errors import SerlError
from serl_cli.training import iteration_time as it
from serl_cli.training.memory import GiB
from serl_cli.training.plan import HEADROOM, Plan


@app.command("plan")
def plan_command(
    config: list[str] = typer.Argument(..., help="The run's config file(s), composed left to right."),
    gpus: int | None = typer.Option(
        None,
        "--gpus",
        help="GPUs per node (default: as many as the config's layout names, else 8); fewer than the "
        "layout names replans it for that many (vLLM keeps its GPUs while the trainer has one left, "
        "else runs colocated), and says how.",
    ),
    gpu_memory: float = typer.Option(80.0, "--gpu-memory", help="Memory of one GPU, GiB."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes."),
    model: str | None = typer.Option(
        None, "--model", help="The model: a directory or a hub name (default: the config's)."
    ),
    prompt_tokens: int = typer.Option(
        2048, "--prompt-tokens", help="A typical prompt's length in tokens (rows per micro-batch, KV cache)."
    ),
    turns: int | None = typer.Option(
        None,
        "--turns",
        help="A typical episode's turns, for the rollouts' disk (default: the turn limit, an upper bound).",
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print one JSON object (phases per rank, disk, verdict) on stdout, no table."
    ),
    set_: list[str] | None = SetOpt,
):
    """Whether a run fits: memory per GPU phase by phase, and disk, before anything loads.

    Per-rank memory of each phase of a run (start-up, generation, scoring, update, checkpoint
    save: weights, gradients, optimizer, activations, logits, teacher, vLLM), the disk per
    checkpoint and for the whole run (rollouts included), and whether the layout fits, before
    anything is loaded; for a vLLM run also its two layouts (split: vLLM on GPUs of its own;
    colocated: an engine per tensor-parallel group of trainer GPUs) and the one serl would pick,
    with an estimate of an iteration's time on each and SERL's ratio to GRPO (arithmetic from
    stated assumptions on H100s, not a measurement)."""
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.plan import Machine, check_machine, compare_layouts, fit_layout, gpus_named, plan_run

    if gpus is not None:
        check_machine(Machine(gpus=gpus, gpu_memory_gb=gpu_memory, nodes=nodes))
    cfg = resolve(OnlineConfig, config_file=config, overrides=set_, flags={"model": model})
    if gpus is None:
        gpus = gpus_named(cfg) or 8
    machine = Machine(gpus=gpus, gpu_memory_gb=gpu_memory, nodes=nodes, prompt_tokens=prompt_tokens)
    check_machine(machine)
    if turns is not None and turns < 1:
        raise SerlError(f"--turns must be at least 1, got {turns}")
    cfg, replanned = fit_layout(cfg, gpus)
    if replanned:
        err_console.print(f"note: {replanned}", highlight=False, soft_wrap=True)
    plan = plan_run(cfg, machine, turns=turns)
    layouts = compare_layouts(cfg, machine, turns=turns) if cfg.rollout.engine == "vllm" else None
    times = time_estimate(cfg, layouts[0], machine, turns) if layouts is not None else None
    if as_json:
        typer.echo(json.dumps(plan_json(plan, replanned, layouts, times), indent=2))
    else:
        print_plan(plan)
        if layouts is not None:
            print_layouts(*layouts)
        if times is not None:
            print_times(times, machine)
    for problem in plan.problems:
        err_console.print(f"[red]does not fit:[/] {problem}", highlight=False, soft_wrap=True)
    if plan.problems:
        raise typer.Exit(1)


def print_plan(plan: Plan) -> None:
    from serl_cli.online.plan import describe

    console.print(memory_table(plan, f"{describe(plan.shape)}: {layout_line(plan)}"))
    console.print(peak_line(plan), highlight=False)
    if plan.vllm:
        share = plan.layout.vllm_utilization * plan.layout.gpu_bytes / GiB
        kv = plan.vllm[-1]
        console.print(
            item_line(f"one vLLM GPU, its share {share:.1f} GiB", plan.vllm) + f"; KV cache: {kv.note}", highlight=False
        )
    console.print(item_line("disk per checkpoint", plan.disk), highlight=False)
    console.print(item_line("disk for the run", plan.run_disk), highlight=False)
    console.print(item_line("CPU memory per node", plan.host), highlight=False)


def print_layouts(options, chosen, why: str) -> None:
    """The vLLM run's two layouts side by side, and the one serl would pick."""
    table = Table(title="vLLM layouts on this node", header_style="bold", title_justify="left")
    for column in ("layout", "GPUs generating", "GPUs training", "peak GiB per GPU", "verdict"):
        table.add_column(column, justify="left" if column in ("layout", "verdict") else "right")
    for o in options:
        table.add_row(o.name, str(o.generating), str(o.training), f"{o.plan.peak.bytes / GiB:.1f}", o.plan.verdict)
    console.print(table)
    for o in options:
        console.print(f"{o.name}: {o.note}", highlight=False, soft_wrap=True)
    console.print(f"serl would pick: {chosen.name}" + (f" -- {why}" if why else ""), highlight=False, soft_wrap=True)


def layouts_json(options, chosen, why: str) -> dict:
    return {
        "options": [
            {
                "name": o.name,
                "generate_gpus": o.generating,
                "train_gpus": o.training,
                "peak_gib": round(o.plan.peak.bytes / GiB, 3),
                "verdict": o.plan.verdict,
                "fits": not o.plan.problems,
                "problems": o.plan.problems,
                "settings": o.note,
            }
            for o in options
        ],
        "pick": chosen.name,
        "why": why,
    }


def items_json(items) -> list[dict]:
    return [{"name": i.name, "bytes": round(i.bytes), "gib": round(i.bytes / GiB, 3), "note": i.note} for i in items]


def total_json(items) -> dict:
    total = sum(i.bytes for i in items)
    return {"items": items_json(items), "bytes": round(total), "gib": round(total / GiB, 3)}


def plan_json(plan: Plan, replanned: str | None = None, layouts=None, times: TimeEstimate | None = None) -> dict:
    """The plan as data: each phase's items per trainer rank, the peak, the verdict, vLLM's own
    GPU, the disk (one checkpoint, the whole run) and a node's CPU memory. Bytes are exact
    counts, GiB rounded."""
    lay = plan.layout
    return {
        "model": {"name": plan.shape.name, "params": plan.shape.params},
        "layout": layout_line(plan),
        "ranks": lay.ranks,
        "gpu_bytes": round(lay.gpu_bytes),
        "phases": [{"name": p.name, **total_json(p.items)} for p in plan.phases],
        "peak": {"phase": plan.peak.name, "bytes": round(plan.peak.bytes), "gib": round(plan.peak.bytes / GiB, 3)},
        "headroom": round(plan.headroom, 4),
        "verdict": plan.verdict,
        "fits": not plan.problems,
        "problems": plan.problems,
        "vllm_gpu": total_json(plan.vllm) if plan.vllm else None,
        "disk": {"checkpoint": total_json(plan.disk), "run": total_json(plan.run_disk)},
        "host": total_json(plan.host),
        "note": replanned,
        "layouts": layouts_json(*layouts) if layouts is not None else None,
        "time": times_json(times) if times is not None else None,
    }


def layout_line(plan: Plan) -> str:
    lay = plan.layout
    precision = "bf16" if lay.half else "fp32"
    if lay.backend == "torch":
        trainer = f"torch backend, {precision}, one GPU"
    else:
        offload = " + offload" if lay.offload else ""
        trainer = f"ZeRO-{lay.zero_stage}{offload}, {precision}, on {lay.ranks} trainer GPU(s)"
    if lay.engine == "vllm":
        engines = f", one engine per {lay.vllm_tp} GPU(s)" if lay.vllm_data_parallel else ", rank 0's engine"
        engine = (
            "vLLM colocated" + engines + (" (asleep during updates)" if lay.vllm_sleep else "")
            if lay.colocated
            else (f"vLLM on {lay.vllm_gpus} GPU(s) of its own (TP {lay.vllm_tp})")
        )
    else:
        engine = f"{lay.engine} engine" if lay.engine != "none" else "no rollouts"
    ckpt = "gradient checkpointing" if lay.gradient_checkpointing else "no gradient checkpointing"
    return f"{trainer}; {engine}; micro-batches of {lay.micro_batch_tokens} tokens, {ckpt}"


def memory_table(plan: Plan, title: str) -> Table:
    """GiB per trainer GPU: a row per item, a column per phase, the totals last."""
    table = Table(title=title, header_style="bold", title_justify="left")
    table.add_column("per trainer GPU, GiB")
    for phase in plan.phases:
        table.add_column(phase.name, justify="right")
    table.add_column("note")
    names: list[str] = []
    notes: dict[str, str] = {}
    for phase in plan.phases:
        for item in phase.items:
            if item.name not in names:
                names.append(item.name)
                notes[item.name] = item.note
    for name in names:
        cells = []
        for phase in plan.phases:
            found = [i.bytes for i in phase.items if i.name == name]
            cells.append(f"{sum(found) / GiB:.2f}" if found else "")
        table.add_row(name, *cells, notes[name])
    table.add_row("total", *(f"{p.bytes / GiB:.2f}" for p in plan.phases), "", style="bold")
    return table


def peak_line(plan: Plan) -> str:
    peak, gb = plan.peak, plan.layout.gpu_bytes / GiB
    verdict = {
        "fits": f"fits, with {plan.headroom:.0%} free",
        "tight": f"fits, but with {plan.headroom:.0%} free (under {HEADROOM:.0%})",
        "does not fit": "does not fit",
    }[plan.verdict]
    return f"peak: the {peak.name} phase, {peak.bytes / GiB:.1f} GiB of {gb:.0f} GiB per GPU: {verdict}"


def item_line(what: str, items) -> str:
    total = sum(i.bytes for i in items)
    parts = ", ".join(f"{i.name} {i.bytes / GiB:.1f}" for i in items if i.bytes)
    return f"{what}: {total / GiB:.1f} GiB ({parts})"


# -- an iteration's time on each layout (an estimate) ---------------------------------------------
STALE_SPLIT = "split, k = 1"  # the split layout with the vLLM producer one update ahead


@dataclass
class TimeEstimate:
    batch: it.Batch
    rows: list[it.IterationTime]
    placements: list[it.Placement]
    teacher: bool  # the config's algorithm scores with a teacher
    with_teacher: int  # iterations the teacher scores for
    iterations: int


def time_estimate(cfg, options, machine, turns: int | None) -> TimeEstimate:
    """Each layout's iteration on H100s (``training.iteration_time``), the split layout also with the
    vLLM producer at max_staleness 1; the config's batch: its episodes, a typical episode's turns
    (``--turns``, else the turn limit), the turn limit for the longest, ``--prompt-tokens`` and
    ``max_new_tokens``."""
    from serl_cli.online.plan import storage_of

    batch = it.Batch(
        episodes=cfg.rollout.tasks * cfg.rollout.group_size,
        turns=storage_of(cfg, turns).turns,
        longest_turns=storage_of(cfg).turns,
        prompt_tokens=machine.prompt_tokens,
        reply_tokens=cfg.rollout.sampling.max_new_tokens,
    )
    placements = [p for o in options for p in placements_of(o)]
    layout = options[0].plan.layout
    rows = [
        it.estimate_iteration(
            options[0].plan.shape, batch, p, teacher=layout.teacher, checkpointing=layout.gradient_checkpointing
        )
        for p in placements
    ]
    a = cfg.annotate
    with_teacher = it.teacher_iterations(cfg.iterations, a.mixing_lambda, a.lambda_decay_steps, a.skip_zero_advantage)
    return TimeEstimate(batch, rows, placements, layout.teacher, with_teacher if layout.teacher else 0, cfg.iterations)


def placements_of(option) -> list[it.Placement]:
    """Where a layout option's phases run: colocated, an engine per ``tensor_parallel_size`` trainer
    GPUs (on every node), asleep during the update; split, one engine on vLLM's own GPUs, and the
    same with the producer at k = 1."""
    lay = option.plan.layout
    generating = lay.ranks if lay.vllm_data_parallel else (lay.vllm_gpus or lay.vllm_tp)
    here = it.Placement(option.name, generating, lay.vllm_tp, lay.ranks, sleeps=lay.vllm_sleep and lay.colocated)
    return [here] + ([replace(here, name=STALE_SPLIT, staleness=1)] if option.name == "split" else [])


def value_range(pair: tuple[float, float], unit: float = 1.0, digits: int = 0) -> str:
    """The range, low-high, in ``unit``s; one figure where both ends round the same."""
    lo, hi = (f"{x / unit:.{digits}f}" for x in sorted(pair))
    return lo if lo == hi else f"{lo}-{hi}"


def run_range(t: it.IterationTime, times: TimeEstimate) -> str:
    lo, hi = (it.run_ratio(r, times.with_teacher, times.iterations) for r in t.over_grpo)
    return value_range((lo, hi), 1, 3)


def print_times(times: TimeEstimate, machine) -> None:
    b = times.batch
    gpus = machine.gpus * machine.nodes
    title = f"Iteration time, estimated for {gpus} x {it.H100_SXM.name} (arithmetic, not measured)"
    table = Table(title=title, header_style="bold", title_justify="left")
    for column in ("layout", "generation s", "pi_old s", "teacher s", "update s", "sync, wake s", "iteration min"):
        table.add_column(column, justify="left" if column == "layout" else "right")
    table.add_column("vs GRPO", justify="right")
    for t in times.rows:
        cells = [value_range(t.generation), f"{t.pi_old:.0f}", f"{t.teacher:.0f}", f"{t.update:.0f}"]
        cells += [f"{t.sync + t.sleep_wake:.0f}", value_range(t.iteration, 60, 1), value_range(t.over_grpo, 1, 2)]
        table.add_row(t.layout, *cells)
    console.print(table)
    print_time_notes(times, b)


def say(line: str) -> None:
    console.print(line, highlight=False, soft_wrap=True)


def print_time_notes(times: TimeEstimate, b: it.Batch) -> None:
    say(
        "generation: throughput-bound (every token's prefill at the MFU below) to decode-bound (the prompts' "
        f"prefill, then {b.longest_turns} turns x {b.reply_tokens} decode steps, each reading the weights and "
        "the KV cache at peak bandwidth)"
    )
    if any(p.staleness for p in times.placements):
        say(
            f"{STALE_SPLIT}: the split's flags and --set max_staleness=1: the vLLM producer on vLLM's GPUs "
            "generates iteration j+1 while the trainer updates on j; once steady an iteration is the longer side "
            "plus the weight sync (rank 0 runs the producer and hands each batch to every trainer process)"
        )
    if times.teacher:
        by = ", ".join(
            f"{t.layout} {value_range(t.over_grpo, 1, 2)}x ({run_range(t, times)}x over the run)" for t in times.rows
        )
        say(
            f"the teacher's iterations against GRPO's on the same layout: {by}; the teacher scores for "
            f"{times.with_teacher} of the run's {times.iterations} iterations (lambda > 0), then is dropped"
        )
    say(
        f"assumptions: {it.H100_SXM.flops / 1e12:.0f} TFLOP/s bf16 and {it.H100_SXM.hbm_bytes_per_s / 1e12:.2f} "
        f"TB/s a GPU; MFU {it.TRAIN_MFU:g} training, {it.PREFILL_MFU:g} prefill; {b.episodes} episodes x {b.turns} "
        f"turns x ({b.prompt_tokens} + {b.reply_tokens}) tokens, all read by pi_old and the update; the teacher "
        f"{it.TEACHER_TOKEN_RATIO:g}x the update's tokens (measured on a CPU on Sokoban, where the block doubles a "
        "short prompt: an upper bound for long prompts); weight sync "
        f"{it.WEIGHT_SYNC_S:g} s, sleep and wake {it.SLEEP_WAKE_S:g} s; environments' steps, evaluations and "
        "saves left out. An estimate: none of it has run on a GPU"
    )


def times_json(times: TimeEstimate) -> dict:
    b, hw = times.batch, it.H100_SXM
    return {
        "estimate": "arithmetic from the assumptions below, not a measurement; none of it has run on a GPU",
        "hardware": {"name": hw.name, "bf16_flops": hw.flops, "hbm_bytes_per_s": hw.hbm_bytes_per_s},
        "assumptions": {
            "train_mfu": hw.train_mfu,
            "prefill_mfu": hw.prefill_mfu,
            "teacher_token_ratio": it.TEACHER_TOKEN_RATIO,
            "weight_sync_s": it.WEIGHT_SYNC_S,
            "sleep_wake_s": it.SLEEP_WAKE_S,
            "replies": "every reply at max_new_tokens; every prompt prefilled whole",
            "trained_tokens": "pi_old and the update read every turn's prompt and reply",
            "left_out": ["environment steps", "evaluations", "checkpoint writes", "vLLM scheduling and sampling"],
        },
        "batch": {
            "episodes": b.episodes,
            "turns": b.turns,
            "longest_turns": b.longest_turns,
            "prompt_tokens": b.prompt_tokens,
            "reply_tokens": b.reply_tokens,
            "tokens": b.tokens,
        },
        "iterations": times.iterations,
        "teacher_iterations": times.with_teacher,
        "layouts": [time_row_json(t, p, times) for t, p in zip(times.rows, times.placements, strict=True)],
    }


def time_row_json(t: it.IterationTime, p: it.Placement, times: TimeEstimate) -> dict:
    def bounds(pair: tuple[float, float]) -> dict:
        return {"throughput_bound": round(pair[0], 4), "decode_bound": round(pair[1], 4)}

    run = tuple(it.run_ratio(r, times.with_teacher, times.iterations) for r in t.over_grpo)
    return {
        "name": t.layout,
        "generate_gpus": p.generating_gpus,
        "engines": p.engines,
        "tensor_parallel": p.tensor_parallel,
        "train_gpus": p.training_gpus,
        "max_staleness": p.staleness,
        "generation_s": bounds(t.generation),
        "pi_old_s": round(t.pi_old, 4),
        "teacher_s": round(t.teacher, 4),
        "update_s": round(t.update, 4),
        "sync_s": t.sync,
        "sleep_wake_s": t.sleep_wake,
        "iteration_s": bounds(t.iteration),
        "over_grpo": bounds(t.over_grpo),
        "over_grpo_run": bounds((run[0], run[1])),
    }
