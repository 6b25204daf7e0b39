"""``serl plan CONFIG``: memory per GPU item by item and phase by phase, the disk per checkpoint
and per run, and whether it fits; for a vLLM run its split and colocated layouts compared;
``--json``: the same as one JSON object on stdout."""

from __future__ import annotations

import json

import typer
from rich.table import Table

from serl_cli.cli.common import resolve
from serl_cli.cli.root import SetOpt, app, console, err_console
from serl_cli.errors import SerlError
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
    colocated: an engine per tensor-parallel group of trainer GPUs) and the one serl would pick."""
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
    if as_json:
        typer.echo(json.dumps(plan_json(plan, replanned, layouts), indent=2))
    else:
        print_plan(plan)
        if layouts is not None:
            print_layouts(*layouts)
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


def plan_json(plan: Plan, replanned: str | None = None, layouts=None) -> dict:
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
