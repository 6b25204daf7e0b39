"""``serl plan CONFIG``: memory per GPU item by item, the disk per checkpoint, and whether it fits."""

from __future__ import annotations

import typer
from rich.table import Table

from serl_cli.cli.common import resolve
from serl_cli.cli.root import SetOpt, app, console, err_console
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
    set_: list[str] | None = SetOpt,
):
    """Per-rank memory of an iteration (weights, gradients, optimizer, activations, logits, teacher,
    vLLM), the disk per checkpoint, and whether the layout fits, before anything is loaded."""
    from serl_cli.stages.online_config import OnlineConfig
    from serl_cli.stages.plan import Machine, check_machine, describe, fit_layout, gpus_named, plan_run

    if gpus is not None:
        check_machine(Machine(gpus=gpus, gpu_memory_gb=gpu_memory, nodes=nodes))
    cfg = resolve(OnlineConfig, config_file=config, overrides=set_, flags={"model": model})
    if gpus is None:
        gpus = gpus_named(cfg) or 8
    machine = Machine(gpus=gpus, gpu_memory_gb=gpu_memory, nodes=nodes, prompt_tokens=prompt_tokens)
    check_machine(machine)
    cfg, replanned = fit_layout(cfg, gpus)
    if replanned:
        err_console.print(f"note: {replanned}", highlight=False, soft_wrap=True)
    plan = plan_run(cfg, machine)
    console.print(memory_table(plan, f"{describe(plan.shape)}: {layout_line(plan)}"))
    console.print(peak_line(plan), highlight=False)
    if plan.vllm:
        share = plan.layout.vllm_utilization * plan.layout.gpu_bytes / GiB
        kv = plan.vllm[-1]
        console.print(
            item_line(f"one vLLM GPU, its share {share:.1f} GiB", plan.vllm) + f"; KV cache: {kv.note}", highlight=False
        )
    disk = sum(i.bytes for i in plan.disk)
    kept = cfg.keep_last + 1 if cfg.keep_last else None
    also = (
        f"; keep_last {cfg.keep_last}: up to {kept} at once while one is written, {kept * disk / GiB:.0f} GiB"
        if kept
        else ""
    )
    console.print(item_line("disk per checkpoint", plan.disk) + also, highlight=False)
    console.print(item_line("CPU memory per node", plan.host), highlight=False)
    for problem in plan.problems:
        err_console.print(f"[red]does not fit:[/] {problem}", highlight=False, soft_wrap=True)
    if plan.problems:
        raise typer.Exit(1)


def layout_line(plan: Plan) -> str:
    lay = plan.layout
    precision = "bf16" if lay.half else "fp32"
    if lay.backend == "torch":
        trainer = f"torch backend, {precision}, one GPU"
    else:
        offload = " + offload" if lay.offload else ""
        trainer = f"ZeRO-{lay.zero_stage}{offload}, {precision}, on {lay.ranks} trainer GPU(s)"
    if lay.engine == "vllm":
        engine = (
            "vLLM colocated" + (" (asleep during updates)" if lay.vllm_sleep else "")
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
