"""``serl rollout``: collect episodes with a model (or the expert, for SFT data)."""

from __future__ import annotations

from serl_cli import api
from serl_cli.cli.common import progress_bar, summary_table
from serl_cli.cli.flags import Given, settings_command
from serl_cli.cli.root import (
    app,
    console,
    journal_resume_option,
    overwrite_option,
    refuse_resume_with_overwrite,
    resumable_at,
)
from serl_cli.stages.rollout import RolloutConfig, stored_rollout_settings


@app.command("rollout")
@settings_command("rollout", RolloutConfig)
def rollout_command(
    given: Given,
    overwrite: bool = overwrite_option("existing rollouts in --out"),
    resume: bool = journal_resume_option("rollout in --out"),
):
    """Run a policy on sampled tasks, G times each; store prompt/action token ids, log-probs and feedback."""
    refuse_resume_with_overwrite(resume, overwrite)
    # `serl rollout --out R --resume` continues R with its own settings: what is given besides must agree
    base = stored_rollout_settings(given.flags["out"]) if resume and given.flags["out"] else None
    cfg = given.resolve(out_dir=True, command="rollout", base=base)
    if resume:
        api.require_run_to_resume(cfg.out, "rollout")  # before the Ctrl-C line names it
    resumable_at(cfg.out)  # what Ctrl-C says
    total = cfg.tasks * cfg.group_size
    with progress_bar(console, "rollout", "episodes", total=total, quiet=given.quiet) as bar:
        s = api.rollout(cfg, overwrite=overwrite, resume=resume, progress=bar.advance).summary
    console.print(
        summary_table(
            f"rollout: {cfg.env.name} {cfg.env.split}, {cfg.policy} policy",
            [
                ("episodes", f"{s['episodes']} ({s['tasks']} tasks x {cfg.group_size})"),
                ("success rate", f"{s['success_rate']:.3f}"),
                ("mean reward", f"{s['mean_reward']:.3f}"),
                ("invalid-action rate", f"{s['invalid_action_rate']:.3f}"),
                ("turns", str(s["turns"])),
                ("episodes ended by an environment error", str(s.get("env_errors", 0))),
                ("generated tokens/s", f"{s['tokens_per_s']:.1f}"),
                ("wall time", f"{s['wall_time_s']:.1f} s"),
            ],
        )
    )
    if not given.quiet:
        console.print(f"wrote {cfg.out}/rollouts.jsonl")
