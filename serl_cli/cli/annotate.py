"""``serl annotate RUN``: feedback, hindsight, placement, teacher scores and weights for a run."""

from __future__ import annotations

import typer

from serl_cli import api
from serl_cli.cli.common import progress_bar, summary_table
from serl_cli.cli.flags import GIVEN_BY_FLAGS, Given, settings_command
from serl_cli.cli.root import app, console, journal_resume_option, overwrite_option
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.online.config import OnlineConfig
from serl_cli.online.derive import prepare_annotation, train_config
from serl_cli.online.run_file import RunFileReader


@app.command("annotate")
@settings_command("annotate", AnnotateConfig, run_file=OnlineConfig, verbose=False)
def annotate_command(
    run: str = typer.Argument(..., help="A run directory with rollouts."),
    given: Given = GIVEN_BY_FLAGS,
    overwrite: bool = overwrite_option("existing annotations"),
    resume: bool = journal_resume_option("annotation pass"),
):
    """Annotate every turn: hindsight block, selected or not, teacher log-probs, SERL weights."""
    # the annotate section and the train settings of a run file (or --set train.*), as the loop reads them
    reader = RunFileReader("annotate", AnnotateConfig, base={"train": {"algo": "serl"}})
    cfg = given.resolve(command="annotate", reader=reader)
    # the algorithm's needs over the command's own flags too, as the loop does; checked before the teacher loads
    run_config = reader.run
    assert run_config is not None  # the reader's base is a run config, so resolving always reads one
    train, cfg = prepare_annotation(cfg, train_config(run_config))
    with progress_bar(console, "teacher", "turns", quiet=given.quiet) as bar:
        s = api.annotate(run, cfg, train=train, overwrite=overwrite, resume=resume, progress=bar.update).summary
    console.print(summary_table(f"annotate: {cfg.sources}, {cfg.granularity}, {cfg.placement}", summary_rows(s)))
    if not given.quiet:
        console.print(f"wrote {run}/annotations.jsonl and {run}/selection_report.json")


def summary_rows(s: dict) -> list[tuple[str, str]]:
    """An annotation pass's summary table: what was selected and scored, and whether the teacher
    tells the student anything (on turns with an expert action)."""
    rows = [
        ("turns", str(s["turns"])),
        ("selected", f"{s['selected']} ({s['selected'] / max(s['turns'], 1):.1%})"),
        ("teacher turns scored", str(s["teacher_turns_scored"])),
        ("teacher tokens scored", f"{s['teacher_tokens_scored']:,}"),
        ("lambda", f"{s['lambda']:.3f}"),
        ("selection vs reward", s["report"].get("tests", {}).get("verdict") or ""),
    ]
    signal = s.get("teacher_signal")
    if signal:
        rows.append(("teacher right direction", f"{signal['right_direction']:.3f} of {signal['turns']} turns"))
        rows.append(("teacher gain on expert action", f"{signal['expert_prob_gain']:+.4f}"))
    return rows
