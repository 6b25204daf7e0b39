"""The whole benchmark suite: every section in one process, one table, one JSON.

    python -m benchmarks [--quick] [--only SECTION,...] [--threads 1] [--seed 0] [--out FILE]

Sections (``SECTIONS``, run in this order):

* ``env_webshop``   WebShop step latency and expert episodes/s (``benchmarks.env_webshop``)
* ``env_sokoban``   Sokoban step latency, solver excluded, and a new room's cost (``benchmarks.env_sokoban``)
* ``env_alfworld``  ALFWorld reset/step latency (``benchmarks.env_alfworld``, its own process;
                    skipped, with the reason, where the script or ALFWorld is absent)
* ``rollout``       generated tokens/s, batched vs per-episode ``generate`` (and vLLM vs
                    transformers where vLLM is installed) (``benchmarks.rollout``)
* ``update``        one step of grpo, serl (placement ``feedback``), rlsd (``all``) and sdpo on the
                    same rollouts: time and peak memory (``benchmarks.train_step``)
* ``online_sokoban`` one SERL online iteration of the Sokoban demo (8 rooms x 8): rollout,
                    annotation and update (``benchmarks.online_sokoban``)
* ``trl``           a GRPO update in serl vs TRL's ``GRPOTrainer`` on the ``update`` batch
                    (``benchmarks.trl_grpo``; skipped without ``trl``)
* ``flops``         training FLOP/s of a GRPO update on the small preset against this
                    machine's fp32 matmul peak (``benchmarks.flops``)
* ``backends``      torch vs DeepSpeed ZeRO stages (``benchmarks.train_backends``, its own
                    process; skipped without ``deepspeed``)

Every comparison is a ratio of two measurements taken in the same run, interleaved where
the section allows, on ``--threads`` torch threads (1 by default), in CPU seconds of the
process (see ``benchmarks.common.Stopwatch``): the machine is shared and noisy.
``--quick`` shrinks every section to a smoke run (tiny preset for ``flops``; its figures
are not the suite's). The table goes to stdout; the JSON (every section's full record,
the table's figures, the settings, wall and CPU time of the whole run) to
``benchmarks/results/suite.json`` (``suite_quick.json`` with ``--quick``) or ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace

from benchmarks import env_sokoban, env_webshop, flops, online_sokoban, rollout, train_step, trl_grpo
from benchmarks.common import (
    RESULTS_DIR,
    Figure,
    Stopwatch,
    figure_rows,
    machine_info,
    missing,
    print_table,
    run_module,
    write_json,
)
from serl_cli.errors import SerlError


@dataclass
class SuiteConfig:
    quick: bool = False
    threads: int = 1
    seed: int = 0
    only: tuple[str, ...] = ()  # empty: every section
    external_timeout_s: float = 1200.0  # a section run as its own process
    env: env_webshop.EnvBench = field(default_factory=env_webshop.EnvBench)
    sokoban: env_sokoban.EnvBench = field(default_factory=env_sokoban.EnvBench)
    online: online_sokoban.OnlineBench = field(default_factory=online_sokoban.OnlineBench)
    rollout: rollout.RolloutBench = field(default_factory=rollout.RolloutBench)
    update: train_step.UpdateBench = field(default_factory=train_step.UpdateBench)
    trl: trl_grpo.PeerBench = field(default_factory=trl_grpo.PeerBench)
    flops: flops.FlopsBench = field(default_factory=flops.FlopsBench)


def suite_config(quick: bool = False, threads: int = 1, seed: int = 0, only: tuple[str, ...] = ()) -> SuiteConfig:
    """The full suite's sizes (about 15 CPU minutes on one thread), or a smoke run's."""
    cfg = SuiteConfig(quick=quick, threads=threads, seed=seed, only=only)
    common = dict(threads=threads, seed=seed)
    if not quick:
        # CPU-second timings vary by a few % between repeats here, so the suite runs fewer
        # repeats than the scripts do alone
        cfg.rollout = replace(cfg.rollout, repeats=1, **common)
        cfg.update = replace(cfg.update, repeats=2, **common)
        cfg.trl = replace(cfg.trl, repeats=2, **common)
        cfg.flops = replace(cfg.flops, repeats=1, **common)
        cfg.online = replace(cfg.online, **common)
        return cfg
    cfg.env = env_webshop.EnvBench(episodes=20)
    cfg.sokoban = env_sokoban.EnvBench(episodes=20, seed=seed)
    cfg.online = online_sokoban.OnlineBench(tasks=2, group_size=2, repeats=1, **common)
    cfg.rollout = rollout.RolloutBench(tasks=1, group_size=2, max_turns=2, max_new_tokens=8, repeats=1, **common)
    cfg.update = train_step.UpdateBench(
        tasks=1, group_size=2, max_turns=2, max_new_tokens=8, repeats=1, fresh_process_memory=False, **common
    )
    cfg.trl = trl_grpo.PeerBench(repeats=1, **common)
    cfg.flops = flops.FlopsBench(
        preset="tiny",
        tasks=1,
        group_size=2,
        max_turns=2,
        max_new_tokens=8,
        repeats=1,
        matmul_sizes=(256, 512),
        **common,
    )
    return cfg


@dataclass
class Context:
    """What one section leaves for a later one: the update batch the TRL comparison reuses."""

    update_batch: train_step.Batch | None = None


SectionFn = Callable[[SuiteConfig, Context], tuple[list[Figure], dict]]
SECTIONS: dict[str, SectionFn] = {}


def section(name: str):
    def register(fn: SectionFn) -> SectionFn:
        SECTIONS[name] = fn
        return fn

    return register


class Skipped(Exception):
    """A section that cannot run here; the message says why."""


def log(msg: str) -> None:
    print(msg, flush=True)


# -- sections --------------------------------------------------------------------------------------
@section("env_webshop")
def _env_webshop(cfg: SuiteConfig, ctx: Context):
    data = env_webshop.measure(cfg.env)
    lat = data["latency"]["all steps"]
    catalog = data["catalog"].split(":")[0]
    return [
        Figure("env_webshop", f"step latency p50 ({catalog}, expert)", lat["p50_ms"], "ms"),
        Figure("env_webshop", "step latency p95", lat["p95_ms"], "ms"),
        Figure("env_webshop", "buy step p95 (reward)", data["latency"]["buy"]["p95_ms"], "ms"),
        Figure("env_webshop", "expert episodes/s", data["expert_episodes_per_s"], "1/s"),
    ], data


@section("env_sokoban")
def _env_sokoban(cfg: SuiteConfig, ctx: Context):
    data = env_sokoban.measure(cfg.sokoban)
    lat = data["latency"]
    us = 1000.0
    return [
        Figure(
            "env_sokoban",
            "step p50 (random policy, solver excluded)",
            lat["step, random, expert off"]["p50_ms"] * us,
            "µs",
            "< 50",
        ),
        Figure("env_sokoban", "step p95", lat["step, random, expert off"]["p95_ms"] * us, "µs"),
        Figure("env_sokoban", "step p50, expert action filled in", lat["step, random, expert on"]["p50_ms"] * us, "µs"),
        Figure("env_sokoban", "new room (generate + solver table) p50", lat["reset, new room"]["p50_ms"], "ms"),
    ], data


@section("env_alfworld")
def _env_alfworld(cfg: SuiteConfig, ctx: Context):
    why = script_absent("env_alfworld") or missing("alfworld", "alfworld")
    if why:
        raise Skipped(why)
    flags = ["--per-type", "1", "--group", "2"] if cfg.quick else []
    data, why = run_module("benchmarks.env_alfworld", [*flags, "--strays"], cfg.external_timeout_s)  # no off-plan study
    if data is None:
        raise Skipped(f"benchmarks.env_alfworld gave no result: {why}")
    try:
        lat, g = data["latency"], data["group_size"]
        figs = [
            Figure("env_alfworld", f"step latency p50 ({data['split']}, expert)", lat["step"]["p50_ms"], "ms"),
            Figure("env_alfworld", "step latency p95", lat["step"]["p95_ms"], "ms"),
            Figure("env_alfworld", "first reset p50", lat["first reset"]["p50_ms"], "ms"),
            Figure("env_alfworld", "repeat reset in a group p50", lat["group reset"]["p50_ms"], "ms"),
            Figure(
                "env_alfworld",
                f"group of {g}: resets / first load",
                data["group_reset_cost_in_first_loads"],
                "x",
                "< 2" if g == 8 else "",
            ),
            Figure("env_alfworld", "expert episodes/s", data["expert_episodes_per_s"], "1/s"),
        ]
    except KeyError:  # the script changed its record: keep what looks like a figure
        figs = external_figures("env_alfworld", data)
    return figs, data


@section("rollout")
def _rollout(cfg: SuiteConfig, ctx: Context):
    data = rollout.measure(cfg.rollout)
    by = {v["variant"]: v for v in data["variants"]}
    figs = [
        Figure("rollout", "batched generate", by["batched"]["tokens_per_s"], "tok/CPU s"),
        Figure("rollout", "per-episode generate", by["per-episode"]["tokens_per_s"], "tok/CPU s"),
        Figure(
            "rollout",
            "batched / per-episode",
            data["ratios"]["batched/per-episode"]["tokens_per_s"],
            "x",
            ">= 1",
            f"{data['episodes']} episodes",
        ),
    ]
    if "vllm/batched" in data["ratios"]:
        figs.append(Figure("rollout", "vllm / hf batched", data["ratios"]["vllm/batched"]["tokens_per_s"], "x"))
    else:
        figs.append(Figure("rollout", "vllm / hf batched", None, "", "", f"skipped: {data['vllm_skipped']}"))
    return figs, data


@section("update")
def _update(cfg: SuiteConfig, ctx: Context):
    ctx.update_batch = train_step.make_batch(cfg.update)
    data = train_step.measure(cfg.update, ctx.update_batch, log=log)
    figs = []
    for v in data["variants"]:
        name = {"serl": "serl (feedback)", "rlsd": "rlsd (all)"}.get(v["variant"], v["variant"])
        figs.append(
            Figure(
                "update",
                f"{name} step",
                v["total_cpu_s"],
                "CPU s",
                "",
                f"x{v['total_over_grpo']:.2f} grpo; teacher scored {v['teacher_turns_scored']} turns",
            )
        )
    for v in data["variants"]:
        fresh = v.get("fresh_process") or {}
        if "peak_rss_mb" in fresh:
            figs.append(
                Figure(
                    "update",
                    f"{v['variant']} peak RSS, fresh process",
                    fresh["peak_rss_mb"],
                    "MB",
                    "",
                    f"+{fresh['step_extra_mb']:.0f} MB in the step",
                )
            )
        else:
            figs.append(Figure("update", f"{v['variant']} step +RSS (in run)", v["step_extra_mb"], "MB"))
    return figs, data


@section("online_sokoban")
def _online_sokoban(cfg: SuiteConfig, ctx: Context):
    data = online_sokoban.measure(cfg.online)
    c, parts = cfg.online, data["parts"]
    size = f"{c.tasks} rooms x {c.group_size}"
    target = "<= 15" if (c.tasks, c.group_size) == (8, 8) else ""
    note = (
        f"{data['turns']:.0f} turns; rollout {parts['rollout']['cpu_s']:.1f} + annotate "
        f"{parts['annotate']['cpu_s']:.1f} + update {parts['update']['cpu_s']:.1f}"
    )
    return [
        Figure("online_sokoban", f"serl iteration ({size}, {c.preset})", data["iteration_cpu_s"], "CPU s", target, note)
    ], data


@section("trl")
def _trl(cfg: SuiteConfig, ctx: Context):
    why = missing("trl", "bench")
    if why:
        raise Skipped(why)
    batch = ctx.update_batch or train_step.make_batch(cfg.update)
    data = trl_grpo.measure(cfg.trl, batch, cfg.update.temperature, log=log)
    note = f"{data['rows']} turns, {data['real_tokens']} tokens, {cfg.trl.repeats} pairs"
    return [
        Figure("trl", "serl GRPO update", data["serl"]["update_cpu_s"], "CPU s", "", note),
        Figure("trl", f"TRL {data['trl']['version']} GRPOTrainer step", data["trl"]["step_cpu_s"], "CPU s"),
        Figure("trl", "serl / TRL time per update", data["ratio_serl_over_trl"], "x", "<= 0.8"),
        Figure(
            "trl",
            "first-step grad norm, |serl - TRL| / TRL",
            data["first_grad_norm_rel_diff"],
            "",
            "<= 0.001",
            "same objective check",
        ),
    ], data


@section("flops")
def _flops(cfg: SuiteConfig, ctx: Context):
    data = flops.measure(cfg.flops, log=log)
    g = 1e9
    target = ">= 0.3" if cfg.flops.preset == "small" else ""
    return [
        Figure(
            "flops",
            f"training 6N ({cfg.flops.preset}, {data['non_embedding_parameters'] / 1e6:.1f}M)",
            data["train_flops_per_s"] / g,
            "GFLOP/CPU s",
            "",
            f"{data['tokens_per_s']:.0f} tok/CPU s",
        ),
        Figure(
            "flops",
            "fp32 matmul peak",
            data["matmul_peak_flops_per_s"] / g,
            "GFLOP/CPU s",
            "",
            f"{cfg.threads} thread(s)",
        ),
        Figure("flops", "training / peak", data["fraction_of_peak"], "", target),
        Figure(
            "flops", "training incl. attention + LM head / peak", data["fraction_of_peak_with_attention_and_head"], ""
        ),
    ], data


@section("backends")
def _backends(cfg: SuiteConfig, ctx: Context):
    why = script_absent("train_backends") or missing("deepspeed", "deepspeed")
    if why:
        raise Skipped(why)
    flags = ["--threads", str(cfg.threads), "--seed", str(cfg.seed), "--repeats", "1"]
    if cfg.quick:
        flags += [
            "--preset",
            "tiny",
            "--episodes",
            "4",
            "--turns",
            "1",
            "--prompt-tokens",
            "64",
            "--action-tokens",
            "8",
        ]
    data, why = run_module("benchmarks.train_backends", flags, cfg.external_timeout_s)
    if data is None:
        raise Skipped(f"benchmarks.train_backends gave no result: {why}")
    try:
        by = {r["backend"]: r for r in data["results"]}
        figs = []
        for name, r in by.items():
            note = (
                f"x{r['update_s'] / by['torch']['update_s']:.2f} torch (wall s, own process)" if "torch" in by else ""
            )
            figs.append(Figure("backends", f"{name} update ({data['preset']})", r["update_s"], "s", "", note))
        figs += [Figure("backends", f"{name} peak RSS", r["peak_rss_mb"], "MB") for name, r in by.items()]
    except KeyError:  # the script changed its record: keep what looks like a figure
        figs = external_figures("backends", data)
    return figs, data


def script_absent(name: str) -> str:
    from pathlib import Path

    path = Path(__file__).parent / f"{name}.py"
    return "" if path.is_file() else f"benchmarks/{name}.py is not in this checkout"


def external_figures(name: str, data: dict, limit: int = 8) -> list[Figure]:
    """Rows for a section written by another script: its numeric leaves (two levels deep) whose
    names say they are a latency, a rate, a memory peak or a ratio. The full record is in the JSON."""
    keys = ("p50", "p95", "per_s", "ratio", "peak", "_over_", "_mb", "speedup")
    figs = []

    def visit(prefix: str, obj, depth: int) -> None:
        for k, v in obj.items():
            label = f"{prefix}{k}"
            if isinstance(v, dict) and depth < 2:
                visit(f"{label}.", v, depth + 1)
            elif isinstance(v, (int, float)) and not isinstance(v, bool) and any(s in k for s in keys):
                figs.append(Figure(name, label, float(v)))

    visit("", data, 0)
    return figs[:limit] or [Figure(name, "ran; see the JSON", None)]


# -- the run ----------------------------------------------------------------------------------------
def run(cfg: SuiteConfig) -> tuple[dict, list[Figure]]:
    """Every selected section in order: the suite's JSON record and the table's figures."""
    unknown = [s for s in cfg.only if s not in SECTIONS]
    if unknown:
        raise SerlError(f"unknown section {unknown[0]!r}: choose from {', '.join(SECTIONS)}")
    names = [s for s in SECTIONS if not cfg.only or s in cfg.only]
    ctx, figures, sections = Context(), [], {}
    with Stopwatch() as whole:
        for name in names:
            log(f"== {name}")
            with Stopwatch() as watch:
                try:
                    figs, data = SECTIONS[name](cfg, ctx)
                    status = "ok"
                except Skipped as e:
                    figs, data, status = [Figure(name, "skipped", None, "", "", str(e))], {"skipped": str(e)}, "skipped"
                except Exception as e:  # one broken section must not lose the others' figures
                    traceback.print_exc()
                    line = f"{type(e).__name__}: {e}".splitlines()[0]
                    figs, data, status = [Figure(name, "FAILED", None, "", "", line)], {"error": line}, "failed"
            data = {"status": status, "wall_s": watch.wall_s, "cpu_s": watch.cpu_s, **data}
            log(f"   {name}: {status} in {watch.wall_s:.0f} s wall, {watch.cpu_s:.0f} CPU s")
            figures += figs
            sections[name] = data
    result = {
        "benchmark": "suite",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **machine_info(),
        "command": " ".join(["python -m benchmarks", *sys.argv[1:]]),
        "config": asdict(cfg),
        "wall_s": whole.wall_s,
        "cpu_s": whole.cpu_s,
        "figures": [f.to_dict() for f in figures],
        "sections": sections,
    }
    return result, figures


COLUMNS = ["section", "figure", "value", "unit", "target", "met", "note"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: every section at tiny sizes")
    ap.add_argument("--only", default="", help=f"comma-separated sections ({', '.join(SECTIONS)})")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for every section")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="the JSON (default benchmarks/results/suite.json)")
    args = ap.parse_args(argv)
    try:
        if args.threads < 1:
            raise SerlError(f"--threads must be at least 1, got {args.threads}")
        only = tuple(s.strip() for s in args.only.split(",") if s.strip())
        cfg = suite_config(args.quick, args.threads, args.seed, only)
        result, figures = run(cfg)
    except SerlError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    title = (
        f"serl benchmark suite{' (quick)' if cfg.quick else ''}: {result['wall_s'] / 60:.1f} min wall, "
        f"{result['cpu_s'] / 60:.1f} CPU min, {cfg.threads} torch thread(s), {result['processor']}"
    )
    print_table(title, COLUMNS, figure_rows(figures))
    out = args.out or RESULTS_DIR / ("suite_quick.json" if cfg.quick else "suite.json")
    print(f"wrote {write_json(out, result)}")
    failed = [n for n, s in result["sections"].items() if s["status"] == "failed"]
    if failed:
        print(f"failed sections: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
