"""``serl model init``: build a small Qwen2-architecture model and its tokenizer offline."""

from __future__ import annotations

from dataclasses import dataclass

import typer

from serl_cli.cli.common import resolve, summary_table
from serl_cli.cli.root import ConfigOpt, SetOpt, app, console
from serl_cli.config import setting
from serl_cli.rollout.worlds import EnvConfig


@dataclass
class ModelInitConfig:
    preset: str = setting("tiny", "tiny (~4M parameters) | small (~25M)")
    env: EnvConfig = setting(
        factory=lambda: EnvConfig(split="train"), doc="the environment whose text trains the tokenizer"
    )
    seed: int = setting(0, "initialization seed")
    out: str = setting("runs/model", "the directory to create (a Hugging Face model directory)")


model_app = typer.Typer(no_args_is_help=True, help="Models: build a local model for tests and demos.")
app.add_typer(model_app, name="model")


@model_app.command("init")
def init(
    preset: str | None = typer.Option(
        None,
        "--preset",
        help="micro (~0.9M parameters: the Sokoban demo's) | tiny (~4M, the default) | small (~25M).",
    ),
    out: str | None = typer.Option(None, "--out", help="Directory to create (a Hugging Face model directory)."),
    env: str | None = typer.Option(None, "--env", help="Environment whose text trains the tokenizer."),
    seed: int | None = typer.Option(None, "--seed", help="Initialization seed."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing directory."),
    config: list[str] | None = ConfigOpt,
    set_: list[str] | None = SetOpt,
):
    """Random-init a Qwen2 model with a byte-level BPE tokenizer trained on environment text."""
    from serl_cli import api
    from serl_cli.models.loading import load_model
    from serl_cli.models.tiny import count_parameters

    cfg = resolve(
        ModelInitConfig,
        config_file=config,
        overrides=set_,
        out_dir=True,
        flags={"preset": preset, "out": out, "env.name": env, "seed": seed},
    )
    path = api.init_model(cfg.out, preset=cfg.preset, env=cfg.env, seed=cfg.seed, overwrite=overwrite)
    model, tokenizer = load_model(str(path))
    console.print(
        summary_table(
            f"model init: {cfg.preset}",
            [
                ("directory", str(path)),
                ("parameters", f"{count_parameters(model):,}"),
                ("vocabulary", f"{len(tokenizer):,}"),
            ],
        )
    )
