"""``serl eval``: a policy (expert, random or a model) over a split's fixed panel."""

from __future__ import annotations

from serl_cli import api
from serl_cli.cli.common import eval_rows, progress_bar, summary_table
from serl_cli.cli.flags import Given, settings_command
from serl_cli.cli.root import app, console, overwrite_option
from serl_cli.stages.evaluate import EvalConfig


@app.command("eval")
@settings_command("eval", EvalConfig)
def eval_command(
    given: Given,
    overwrite: bool = overwrite_option("an existing evaluation in --out"),
):
    """Evaluate a policy on a split's fixed panel: success with a 95 % interval, score, turns."""
    cfg = given.resolve(out_dir=True, command="eval")
    with progress_bar(console, "eval", "episodes", total=cfg.episodes, quiet=given.quiet) as bar:
        summary = api.evaluate(cfg, overwrite=overwrite, progress=bar.advance)
    console.print(summary_table(f"{summary['env']} {summary['split']}: {summary['policy']} policy", eval_rows(summary)))
    if not given.quiet:
        console.print(f"wrote {cfg.out}/eval.json")
