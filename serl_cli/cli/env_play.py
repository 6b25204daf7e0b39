"""``serl env play``: step one task by hand (a prompt per turn) or by script (``--actions``)."""

from __future__ import annotations

import json

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.text import Text

from envs.base import Step
from serl_cli.cli.common import resolve
from serl_cli.cli.root import ConfigOpt, SetOpt, console, env_app
from serl_cli.errors import SerlError
from serl_cli.rollout.worlds import EnvConfig, build_world


def _show(step: Step, turn: int, action: str | None, as_json: bool) -> None:
    if as_json:
        console.print_json(
            json.dumps(
                {
                    "turn": turn,
                    "action": action,
                    "observation": step.observation,
                    "reward": step.reward,
                    "done": step.done,
                    "feedback": step.feedback.to_dict(),
                    "state_key": step.state_key,
                    "expert_action": step.expert_action,
                    "admissible_actions": step.admissible_actions,
                }
            )
        )
        return
    title = escape(f"turn {turn}" + (f": {action}" if action else ": reset"))
    console.print(Panel(Text(step.observation), title=title, title_align="left"))
    fb = step.feedback
    if fb.error:
        console.print(f"[red]error:[/] {escape(fb.error)}", highlight=False)
    console.print(
        f"[cyan]diff:[/] {escape(fb.diff)}   [cyan]reward:[/] {step.reward}   [cyan]done:[/] {step.done}",
        highlight=False,
    )
    if not step.done:
        console.print(
            f"[dim]admissible: {escape(', '.join(step.admissible_actions[:30]))}"
            f"{' ...' if len(step.admissible_actions) > 30 else ''}[/]",
            highlight=False,
        )
        console.print(f"[dim]expert: {escape(str(step.expert_action))}[/]", highlight=False)


QUIT_WORDS = ("quit", "exit", ":q")
QUIT_HINT = "quit, exit, Ctrl-D or Ctrl-C stops"


@env_app.command("play")
def play(
    env: str = typer.Option(
        "webshop",
        "--env",
        help="Environment: webshop, alfworld, sokoban, an installed serl.envs entry point, or "
        "package.module:factory (docs/ENVIRONMENTS.md).",
    ),
    split: str | None = typer.Option(
        None, "--split", help="Split the task comes from (default: the env's evaluation split)."
    ),
    task: int = typer.Option(0, "--task", help="Task id within the split (0-based, in panel order)."),
    actions: str | None = typer.Option(
        None, "--actions", help='Actions separated by ";" (no prompt): "search[...];click[...]".'
    ),
    max_turns: int | None = typer.Option(None, "--max-turns", help="Turn limit."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per step, for scripts."),
    config: list[str] | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
):
    """Play one task: print each observation, its feedback and reward. Interactive without --actions:
    type quit (or exit, Ctrl-D, Ctrl-C) to stop."""
    cfg = resolve(
        EnvConfig, config_file=config, overrides=set_, flags={"name": env, "split": split, "max_turns": max_turns}
    )
    world = build_world(cfg)
    episode = world.new_episode(cfg.split, cfg.max_turns)
    step = episode.reset(task)
    _show(step, 0, None, as_json)
    script = [a.strip() for a in actions.split(";") if a.strip()] if actions is not None else None
    if script is not None and not script:
        raise SerlError("--actions holds no action: give actions separated by ';'")
    if script is None and not as_json:
        console.print(f"[dim]type an action and press Enter; {QUIT_HINT}[/]", highlight=False)
    turn = 0
    while not step.done:
        if script is not None:
            if turn >= len(script):
                break
            action = script[turn]
        else:
            try:
                action = console.input("[bold]action>[/] ").strip()
            except (EOFError, KeyboardInterrupt):  # Ctrl-D, Ctrl-C: the player is done
                console.print()
                break
            if action.lower() in QUIT_WORDS:  # never sent to the environment as an action
                break
            if not action:
                continue
        turn += 1
        step = episode.step(action)
        _show(step, turn, action, as_json)
    if not as_json:
        console.print(
            f"[bold]episode {'over' if step.done else 'stopped'}[/]: reward {step.reward}, {turn} turns",
            highlight=False,
        )
