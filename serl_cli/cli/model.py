"""``serl model init``: build a small Qwen2-architecture model and its tokenizer offline;
``serl model fetch``: a real pretrained chat model (a GGUF, downloaded or local) as a model directory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import typer

from serl_cli.cli.common import summary_table
from serl_cli.cli.flags import GIVEN_BY_FLAGS, Flag, Given, settings_command
from serl_cli.cli.root import app, console, overwrite_option
from serl_cli.config import setting
from serl_cli.errors import SerlError
from serl_cli.rollout.worlds import EnvConfig

Preset = Literal["micro", "tiny", "small"]  # serl_cli.models.tiny.PRESETS (tests/test_model_fetch.py checks)
FetchDtype = Literal["bf16", "fp16", "fp32"]  # serl_cli.models.gguf_weights.DTYPE_WORDS


@dataclass
class ModelInitConfig:
    preset: Preset = setting(
        "tiny", "micro (~0.9M parameters: the Sokoban demo's) | tiny (~4M) | small (~25M): serl_cli/models/tiny.py"
    )
    env: EnvConfig = setting(
        factory=lambda: EnvConfig(split="train"), doc="the environment whose text trains the tokenizer"
    )
    seed: int = setting(0, "initialization seed")
    out: str = setting("runs/model", "the directory to create (a Hugging Face model directory)")


@dataclass
class ModelFetchConfig:
    model: str | None = setting(None, "a model serl knows (smollm2-135m-instruct); null: convert --gguf")
    gguf: str | None = setting(None, "a local GGUF file to convert instead of a model serl knows")
    sha256: str | None = setting(None, "the --gguf file's expected sha256; null: not checked")
    dtype: FetchDtype = setting("bf16", "the dtype of the saved weights")
    out: str | None = setting(None, "the directory to create (a Hugging Face model directory); required")


# The model commands' flags: declared here, not in flags.FLAGS, whose flags are the stages'
# (tests/test_cli_flags.py holds FLAGS to them); made into options by the same settings_command.
MODEL_FLAGS = (
    Flag("--preset", {"model init": "preset"}),
    Flag("--env", {"model init": "env.name"}, help="Environment whose text trains the tokenizer."),
    Flag("--gguf", {"model fetch": "gguf"}),
    Flag("--sha256", {"model fetch": "sha256"}),
    Flag("--dtype", {"model fetch": "dtype"}),
    Flag("--out", {"model init": "out", "model fetch": "out"}),
)


model_app = typer.Typer(
    no_args_is_help=True,
    help="Models: build a small local model for tests and demos, or fetch a real pretrained one.",
)
app.add_typer(model_app, name="model")


@model_app.command("init")
@settings_command("model init", ModelInitConfig, verbose=False, flags=MODEL_FLAGS)
def init(given: Given, overwrite: bool = overwrite_option("an existing model directory in --out")):
    """Random-init a Qwen2 model with a byte-level BPE tokenizer trained on environment text."""
    from serl_cli import api
    from serl_cli.models.loading import load_model
    from serl_cli.models.tiny import count_parameters

    cfg = given.resolve(out_dir=True)
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


@model_app.command("fetch")
@settings_command("model fetch", ModelFetchConfig, verbose=False, flags=MODEL_FLAGS)
def fetch(
    name: str | None = typer.Argument(
        None, metavar="NAME", help="A model serl knows: smollm2-135m-instruct (or --gguf FILE)."
    ),
    given: Given = GIVEN_BY_FLAGS,
    overwrite: bool = overwrite_option("an existing model directory in --out"),
):
    """Fetch a pretrained chat model (a GGUF: downloaded once and cached, or --gguf FILE) as a model directory."""
    from serl_cli import api

    if given.flags.pop("seed") is not None:
        raise SerlError("serl model fetch takes no --seed: the conversion is deterministic")
    given = dataclasses.replace(given, flags={**given.flags, "model": name})
    cfg = given.resolve(out_dir=True)
    if not cfg.out:
        raise SerlError("serl model fetch needs --out DIR: the model directory to create")

    def say(line: str) -> None:  # each step, on stdout: stderr holds only an error's one line
        if not given.quiet:
            console.print(line, highlight=False, markup=False, soft_wrap=True)

    record = api.fetch_model(
        cfg.out, cfg.model, gguf=cfg.gguf, sha256=cfg.sha256, dtype=cfg.dtype, overwrite=overwrite, say=say
    )
    model, source = record["model"], record["source"]
    stops = (model["stop_tokens"], model["stop_token_ids"])
    console.print(
        summary_table(
            f"model fetch: {source.get('model') or record['gguf']['file']}",
            [
                ("directory", cfg.out),
                ("parameters", f"{model['parameters']:,}"),
                ("vocabulary", f"{model['vocabulary']:,}"),
                ("dtype", cfg.dtype),
                ("stop tokens", ", ".join(f"{t} ({i})" for t, i in zip(*stops, strict=True))),
                ("weights", f"{model['safetensors_bytes'] / 1e6:,.1f} MB"),
            ],
        )
    )
