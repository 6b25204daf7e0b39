"""``serl annotate RUN``: feedback, hindsight, placement, teacher scores and weights for a run."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from serl_cli.cli.common import resolve, save_resolved, show_defaults, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, app, console
from serl_cli.method.annotation import AnnotateConfig
from serl_cli.stages.annotate import run_annotate


@app.command("annotate")
@show_defaults(AnnotateConfig, sources="sources", granularity="granularity", placement="placement")
def annotate_command(
    run: str = typer.Argument(..., help="A run directory with rollouts."),
    sources: str | None = typer.Option(
        None,
        "--sources",
        help="Feedback sources: error, diff, obs, future, ref; ',' combines, '|' falls back (e.g. 'ref|error').",
    ),
    granularity: str | None = typer.Option(None, "--granularity", help="step | anchor."),
    placement: str | None = typer.Option(None, "--placement", help="feedback | gap | all | random."),
    teacher: str | None = typer.Option(None, "--teacher", help="Teacher model (default: the rollouts' policy)."),
    threads: int | None = typer.Option(None, "--threads", help="Torch threads (default: all cores)."),
    device: str | None = typer.Option(
        None, "--device", help="The teacher's device: auto (CUDA when present) | cpu | cuda."
    ),
    dtype: str | None = typer.Option(
        None,
        "--dtype",
        help="The teacher's precision: auto (bf16 on a GPU with it, else fp32) | fp32 | bf16 | fp16 (autocast).",
    ),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing annotations."),
    resume: bool = typer.Option(
        False,
        "--resume",
        help="Continue an interrupted annotation pass from its journal "
        "(same settings); a finished one is left as it is.",
    ),
    config: list[str] | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
    seed: int | None = SeedOpt,
    quiet: bool = QuietOpt,
):
    """Annotate every turn: hindsight block, selected or not, teacher log-probs, SERL weights."""
    cfg = resolve(
        AnnotateConfig,
        config_file=config,
        overrides=set_,
        flags={
            "sources": sources,
            "granularity": granularity,
            "placement": placement,
            "teacher": teacher,
            "threads": threads,
            "seed": seed,
            "device": device,
            "dtype": dtype,
        },
        command="annotate",
        quiet=quiet,
    )
    with Progress(
        TextColumn("[bold]teacher"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
        disable=quiet,
        transient=True,
    ) as bar:
        task = bar.add_task("turns", total=None)
        s = run_annotate(
            run,
            cfg,
            overwrite=overwrite,
            resume=resume,
            progress=lambda done, total: bar.update(task, completed=done, total=total),
        )
    save_resolved(run, "annotate.yaml", cfg)
    rep = s["report"]
    rows = [
        ("turns", str(s["turns"])),
        ("selected", f"{s['selected']} ({s['selected'] / max(s['turns'], 1):.1%})"),
        ("teacher turns scored", str(s["teacher_turns_scored"])),
        ("teacher tokens scored", f"{s['teacher_tokens_scored']:,}"),
        ("lambda", f"{s['lambda']:.3f}"),
        ("selection vs reward", rep.get("tests", {}).get("verdict") or ""),
    ]
    signal = s.get("teacher_signal")
    if signal:  # is the hindsight teacher telling the student anything? (turns with an expert action)
        rows.append(("teacher right direction", f"{signal['right_direction']:.3f} of {signal['turns']} turns"))
        rows.append(("teacher gain on expert action", f"{signal['expert_prob_gain']:+.4f}"))
    console.print(summary_table(f"annotate: {cfg.sources}, {cfg.granularity}, {cfg.placement}", rows))
    if not quiet:
        console.print(f"wrote {run}/annotations.jsonl and {run}/selection_report.json")
