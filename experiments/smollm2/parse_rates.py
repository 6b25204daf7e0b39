"""Parse rates of a real chat model's replies: how often serl finds an action in what it writes.

    serl model fetch smollm2-135m-instruct --out models/smollm2
    SERL_DATA_DIR=/path/to/data python experiments/smollm2/parse_rates.py --model models/smollm2 \
        [--tasks 16] [--envs sokoban,webshop,alfworld] [--temperatures 1.0,0.4,0] [--out FILE]

For each environment, prompt and temperature, the model plays the first turn of ``--tasks`` train
tasks (one reply each, through serl's rollout stage: the same prompts, chat template, stop tokens
and parser as a training run) and the table gives, per cell:

* ``parsed``: the share of replies the prompt style's own rule takes an action from -- serl's
  parser (``rollout.prompts.parse_action``: the last ``<action>...</action>``, or a bare action
  in the environment's format) for ``prompt.style: serl``; the authors' rule (both action tags
  and both think tags) for ``prompt.style: authors`` -- with its 95 % Wilson interval;
* ``tagged``: the share with an ``<action>...</action>`` at all (what the authors' rule needs
  besides the think tags);
* ``valid``: the share the environment accepted (no ``error`` feedback: a parsed move into a
  wall is parsed but not valid);
* ``stopped``: the share that ended with the end-of-turn token rather than at the token budget;
* the mean reply length in tokens.

Prompts: serl's own (``prompt.style: serl``, the environment's rules in a system message),
the paper authors' (``prompt.style: authors``) and, where ``experiments/smollm2/<env>.yaml``
(and ``<env>_*.yaml``) exists, that file's (the setting that makes this model act). One reply per task: the first turn
only, so no reply is conditioned on the model's own earlier replies. WebShop uses the real
catalog when ``SERL_DATA_DIR`` holds it, else the synthetic one (the JSON says which); an
environment that cannot be built here (ALFWorld without its extra or data) is skipped with the
reason. Writes ``--out`` (default ``docs/results/smollm2/parse_rates.json``) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from envs.authors import tagged_action
from envs.base import AuthorsPrompted
from serl_cli import api
from serl_cli.artifacts import io
from serl_cli.errors import SerlError
from serl_cli.models.loading import load_model, set_torch_threads
from serl_cli.rollout.engines.hf import HFEngine
from serl_cli.rollout.prompts import action_format_of, end_of_turn_id, parse_action
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.rollout import run_rollout
from serl_cli.stats.summary import wilson_interval

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
DEFAULT_OUT = ROOT / "docs" / "results" / "smollm2" / "parse_rates.json"
STYLES = ("serl", "authors")
SYNTHETIC = {"catalog": "synthetic"}  # WebShop without the real catalog: whether the environment runs at all


def prompt_rows(env: str) -> list[tuple[str, list[str], list[str]]]:
    """(label, config files, overrides) of each prompt measured on ``env``."""
    rows: list[tuple[str, list[str], list[str]]] = [(style, [], [f"prompt.style={style}"]) for style in STYLES]
    for own in sorted(HERE.glob(f"{env}*.yaml")):
        rows.append((f"smollm2/{own.name}", [str(own)], []))
    return rows


def env_overrides(env: str) -> list[str]:
    """WebShop on the synthetic catalog where the real one is not in ``SERL_DATA_DIR``."""
    if env != "webshop":
        return []
    try:
        build_world(EnvConfig(name="webshop", split="train", settings={"catalog": "real"}))
        return ["env.settings.catalog=real"]
    except SerlError:
        return ["env.settings.catalog=synthetic"]


def rollout_config(env: str, files: list[str], overrides: list[str], tasks: int, temperature: float, out: str):
    """The rollout a cell runs: the prompt's settings, then one first turn of ``tasks`` train tasks."""
    sets = [*env_overrides(env), *overrides, f"env.name={env}", "env.split=train", "env.max_turns=1"]
    cfg = api.load_config("rollout", files, sets)
    sampling = dataclasses.replace(cfg.sampling, temperature=temperature)
    return dataclasses.replace(cfg, tasks=tasks, group_size=1, sampling=sampling, out=out, seed=0, threads=1)


def replies_parsed(episodes, cfg, tokenizer) -> dict:
    """The cell's shares (see the module's docstring) over every reply of ``episodes``."""
    world = build_world(cfg.env)
    fmt = action_format_of(world)
    eot = end_of_turn_id(tokenizer)
    turns = [t for e in episodes for t in e.turns]
    if cfg.prompt.style == "authors":
        assert isinstance(world, AuthorsPrompted)  # the rollout's check_style made sure of it
        parsed = [world.authors_prompt.project(t.action_text)[1] is None for t in turns]
    else:
        parsed = [parse_action(t.action_text, fmt)[1] is None for t in turns]
    n = len(turns)
    k = sum(parsed)
    return {
        "replies": n,
        "parsed": k / n,
        "parsed_ci95": wilson_interval(k, n),
        "tagged": sum(tagged_action(t.action_text) is not None for t in turns) / n,
        "valid": sum(not t.invalid_action for t in turns) / n,
        "stopped": sum(bool(t.action_ids) and t.action_ids[-1] == eot for t in turns) / n,
        "mean_tokens": sum(len(t.action_ids) for t in turns) / n,
        "examples": [t.action_text for t in turns[:3]],
    }


def cell(env: str, label: str, files, overrides, temperature: float, args, model, tokenizer, engine) -> dict:
    with tempfile.TemporaryDirectory(prefix="serl-parse-") as tmp:
        cfg = rollout_config(env, files, overrides, args.tasks, temperature, str(Path(tmp) / "run"))
        t0 = time.perf_counter()
        run_rollout(cfg, overwrite=True, model=model, tokenizer=tokenizer, engine=engine)
        episodes = api.read_rollouts(cfg.out)
        row = {
            "env": env,
            "prompt": label,
            "temperature": temperature,
            "max_new_tokens": cfg.sampling.max_new_tokens,
            "catalog": cfg.env.settings.get("catalog"),
            **replies_parsed(episodes, cfg, tokenizer),
            "seconds": round(time.perf_counter() - t0, 1),
        }
    print(
        f"{env:9} {label:24} T {temperature:<4} parsed {row['parsed']:.3f} valid {row['valid']:.3f} "
        f"stopped {row['stopped']:.3f} ({row['seconds']} s)",
        file=sys.stderr,
        flush=True,
    )
    return row


def temperatures_for(label: str, files: list[str], asked: list[float]) -> list[float]:
    """The asked temperatures; a config of this folder also at its own."""
    if not files:
        return asked
    own = api.load_config("rollout", files, []).sampling.temperature
    return sorted({*asked, own}, reverse=True)


def table(rows: list[dict]) -> list[list]:
    return [
        [
            r["env"],
            r["prompt"],
            r["temperature"],
            r["max_new_tokens"],
            r["replies"],
            r["parsed"],
            "[{:.3f}, {:.3f}]".format(*r["parsed_ci95"]),
            r["tagged"],
            r["valid"],
            r["stopped"],
            r["mean_tokens"],
        ]
        for r in rows
    ]


COLUMNS = ["env", "prompt", "T", "max new", "replies", "parsed", "95% CI", "tagged", "valid", "stopped", "tokens"]


def show(title: str, rows: list[list]) -> None:
    """The table on stdout, as wide as it needs in a log."""
    out = Table(title=title)
    for c in COLUMNS:
        out.add_column(c, justify="left" if c in ("env", "prompt") else "right")
    for r in rows:
        out.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r])
    Console(width=None if sys.stdout.isatty() else 200).print(out)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="the model directory (serl model fetch smollm2-135m-instruct)")
    ap.add_argument("--tasks", type=int, default=16, help="train tasks per cell: one first-turn reply each")
    ap.add_argument("--envs", default="sokoban,webshop,alfworld")
    ap.add_argument("--temperatures", default="1.0,0.4,0")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    args = ap.parse_args(argv)
    set_torch_threads(1)
    model, tokenizer = load_model(args.model)
    model.eval()
    engine = HFEngine(model, tokenizer)
    asked = [float(t) for t in args.temperatures.split(",")]
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    t0 = time.perf_counter()
    for env in args.envs.split(","):
        try:
            build_world(EnvConfig(name=env, split="train", settings=SYNTHETIC if env == "webshop" else {}))
        except (SerlError, ImportError) as e:  # the environment cannot run here: say why, measure the rest
            skipped[env] = str(e).splitlines()[0]
            print(f"{env}: skipped ({skipped[env]})", file=sys.stderr)
            continue
        for label, files, overrides in prompt_rows(env):
            for temperature in temperatures_for(label, files, asked):
                rows.append(cell(env, label, files, overrides, temperature, args, model, tokenizer, engine))
    data = {
        "model": args.model,
        "tasks_per_cell": args.tasks,
        "skipped": skipped,
        "wall_s": round(time.perf_counter() - t0, 1),
        "rows": rows,
        "note": "SmolLM2-135M-Instruct as serl model fetch installs it: the Q4_1 GGUF dequantized, not the "
        "original weights; one first-turn reply per train task",
    }
    show(f"reply parse rates, {args.model}", table(rows))
    io.write_json(args.out, {"benchmark": "parse_rates", "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **data})
    print(f"wrote {args.out}")
    return data


if __name__ == "__main__":
    main()
