"""``serl annotate RUN``: feedback, hindsight, placement, teacher scores and weights for a run."""

from __future__ import annotations

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from serl_cli import api
from serl_cli.cli.common import LogProgress, resolve, show_defaults, summary_table
from serl_cli.cli.root import ConfigOpt, QuietOpt, SeedOpt, SetOpt, app, console
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.stages.derive import prepare_annotation, train_config
from serl_cli.stages.run_file import RunFileReader


@app.command("annotate")
@show_defaults(
    AnnotateConfig,
    sources="sources",
    granularity="granularity",
    placement="placement",
    teacher="teacher",
    threads="threads",
    device="device",
    dtype="dtype",
)
def annotate_command(
    run: str = typer.Argument(..., help="A run directory with rollouts."),
    algo: str | None = typer.Option(
        None,
        "--algo",
        help="The algorithm the annotations feed (default serl; else the run config's train.algo): its needs "
        "are applied (rlsd: placement all, tokens reply; distillation: skip_zero_advantage false), and the "
        "train settings (--config RUN_FILE, --set train.KEY=VALUE) sign the weights, as in the online loop.",
    ),
    sources: str | None = typer.Option(None, "--sources"),
    granularity: str | None = typer.Option(None, "--granularity"),
    placement: str | None = typer.Option(None, "--placement"),
    teacher: str | None = typer.Option(None, "--teacher"),
    threads: int | None = typer.Option(None, "--threads"),
    device: str | None = typer.Option(None, "--device"),
    dtype: str | None = typer.Option(None, "--dtype"),
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
    # the annotate section and the train settings of a run file (or --set train.*), as the loop reads them
    reader = RunFileReader("annotate", AnnotateConfig, base={"train": {"algo": "serl"}})
    cfg = resolve(
        AnnotateConfig,
        config_file=config,
        overrides=set_,
        flags={
            "train.algo": algo,
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
        reader=reader,
    )
    # the algorithm's needs over the command's own flags too, as the loop does; checked before the teacher loads
    train, cfg = prepare_annotation(cfg, train_config(reader.run))
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
        lines = LogProgress(console, "teacher", "turns", quiet=quiet)

        def progress(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)
            lines.update(done, total)

        s = api.annotate(run, cfg, train=train, overwrite=overwrite, resume=resume, progress=progress).summary
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
