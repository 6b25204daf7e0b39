"""``serl model init``: build a small Qwen2-architecture model and its tokenizer offline."""

from __future__ import annotations

from typing import List, Optional

import typer

from serl_cli.cli import SetOpt, app, console
from serl_cli.commands.common import resolve, summary_table
from serl_cli.settings import EnvConfig, build_world

model_app = typer.Typer(no_args_is_help=True, help="Models: build a local model for tests and demos.")
app.add_typer(model_app, name="model")


@model_app.command("init")
def init(
    preset: str = typer.Option("tiny", "--preset", help="tiny (~4M parameters) | small (~25M)."),
    out: str = typer.Option(..., "--out", help="Directory to create (a Hugging Face model directory)."),
    env: str = typer.Option("webshop", "--env", help="Environment whose text trains the tokenizer."),
    seed: int = typer.Option(0, "--seed", help="Initialization seed."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing directory."),
    set_: Optional[List[str]] = SetOpt,
):
    """Random-init a Qwen2 model with a byte-level BPE tokenizer trained on environment text."""
    from serl_cli.default_model import tokenizer_corpus
    from serl_cli.model import PRESETS, ModelError, count_parameters, init_model, load_model

    if preset not in PRESETS:
        raise ModelError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    cfg = resolve(EnvConfig, config_file=None, overrides=set_, flags={"name": env, "split": "train"})
    world = build_world(cfg)
    path = init_model(preset, out, tokenizer_corpus(world), seed=seed, overwrite=overwrite)
    model, tokenizer = load_model(str(path))
    console.print(summary_table(f"model init: {preset}", [
        ("directory", str(path)), ("parameters", f"{count_parameters(model):,}"), ("vocabulary", f"{len(tokenizer):,}")]))
