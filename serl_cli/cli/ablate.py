"""``serl ablate``: run a grid of online runs, emit it as a SLURM job array, or report on it.

    serl ablate experiments/ablations/sources.yaml --out runs/abl          # every cell here, then the report
    serl ablate --env webshop --sources error,obs,ref --seeds 3 --out runs/abl --emit slurm
    serl ablate experiments/ablations/sources.yaml --out runs/abl --cell 4 # one cell (what array task 4 runs)
    serl ablate --report runs/abl                                          # aggregate what has finished

The grid rule (axes, the flags shorthand, cell names) is in :mod:`serl_cli.ablate.grid`, its record
``OUT/grid.json`` in :mod:`serl_cli.ablate.grid_record`; the report in :mod:`serl_cli.ablate.report`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import typer

from serl_cli.ablate import cells, reuse, runners
from serl_cli.ablate import grid as ab
from serl_cli.ablate.grid_record import grid_record, load_grid_record, same_grid, write_grid
from serl_cli.cli.common import summary_table
from serl_cli.cli.root import QuietOpt, SetOpt, VerboseOpt, app, console, err_console
from serl_cli.errors import PREEMPTED_EXIT, SerlError


def _report(out: Path, quiet: bool, keep: str | None = None) -> None:
    from serl_cli.ablate.report import write_report
    from serl_cli.stats.summary import fmt

    if keep is not None:  # the summaries go to KEEP, and the report is built from them alone
        kept = reuse.keep_summaries(out, keep)
        console.print(f"{kept} cells' summaries kept in {keep}", highlight=False)
        out = Path(keep)
    res = write_report(out)
    rows = [
        (
            r["arm"],
            f"{fmt(r['success_mean'])} ± {fmt(r['success_std'])}  (n={r['seeds_done']})"
            + ("" if r["p_success"] is None else f"  p={r['p_success']:.3g}"),
        )
        for r in res["rows"]
    ]
    if res["unfinished"]:
        rows.append(("unfinished cells", str(len(res["unfinished"]))))
    console.print(summary_table(f"ablation {out}: success over seeds (baseline {res['baseline']})", rows))
    console.print(
        f"report: {out / 'report.md'}, {out / 'report.csv'}"
        + (f", {out / 'contrasts.csv'} ({len(res['contrasts'])} contrasts)" if res["contrasts"] else "")
        + (f", {out / 'curves.png'}" if res["plot"] else " (no plot: matplotlib missing)"),
        highlight=False,
    )


# ablate's options: the first eight, the grid from the command line (serl_cli.ablate.grid's flags
# shorthand), are written into the cells' command lines as given
OPTIONS = {
    "env": typer.Option(None, "--env", help="Environments (comma list): the env axis."),
    "algo": typer.Option(None, "--algo", help="Algorithms (comma list): the algo axis."),
    "sources": typer.Option(
        None, "--sources", help="Without a grid file: one SERL arm per source, one with all combined, and GRPO."
    ),
    "granularity": typer.Option(None, "--granularity", help="Granularities (comma list)."),
    "placement": typer.Option(None, "--placement", help="Placements (comma list)."),
    "seeds": typer.Option(None, "--seeds", help="Seeds per arm: 0..N-1."),
    "iterations": typer.Option(None, "--iterations", help="Online iterations per cell."),
    "episodes": typer.Option(None, "--episodes", help="Final evaluation: test-panel episodes per cell."),
    "out": typer.Option(None, "--out", help="The ablation directory (default runs/ablate)."),
    "cell": typer.Option(None, "--cell", help="Run only cell i (what SLURM array task i runs)."),
    "parallel": typer.Option(
        1, "--parallel", help="Cells at a time here (subprocesses); with --emit slurm: the array's concurrency limit."
    ),
    "max_parallel": typer.Option(
        None,
        "--max-parallel",
        help="--emit slurm: array tasks running at once (%N); default: slurm.max_parallel of the grid, else no cap.",
    ),
    "emit": typer.Option(None, "--emit", help="slurm: write OUT/ablate.sbatch instead of running."),
    "slurm_template": typer.Option(
        None, "--slurm-template", help="A sbatch template with {array} and {command} placeholders."
    ),
    "report": typer.Option(False, "--report", help="Aggregate finished cells into report.md/.csv and curves.png."),
    "keep": typer.Option(
        None,
        "--keep",
        help="With --report: copy the cells' small summaries to this folder and build the report there (commit "
        "it; `serl ablate --report DIR` rebuilds it).",
    ),
    "reuse": typer.Option(
        None,
        "--reuse",
        help="Copy the cells another ablation directory finished, where they are the same cell, instead of "
        "training them again (repeatable).",
    ),
    "config": typer.Option(None, "--config", help="A YAML file of grid settings (one file)."),
}


@app.command("ablate")
def ablate_command(
    grid_file: str | None = typer.Argument(
        None, help="A grid file (experiments/ablations/*.yaml); with --report and no --out: the ablation directory."
    ),
    env: str | None = OPTIONS["env"],
    algo: str | None = OPTIONS["algo"],
    sources: str | None = OPTIONS["sources"],
    granularity: str | None = OPTIONS["granularity"],
    placement: str | None = OPTIONS["placement"],
    seeds: int | None = OPTIONS["seeds"],
    iterations: int | None = OPTIONS["iterations"],
    episodes: int | None = OPTIONS["episodes"],
    out: str | None = OPTIONS["out"],
    cell: int | None = OPTIONS["cell"],
    parallel: int = OPTIONS["parallel"],
    max_parallel: int | None = OPTIONS["max_parallel"],
    emit: str | None = OPTIONS["emit"],
    slurm_template: str | None = OPTIONS["slurm_template"],
    report: bool = OPTIONS["report"],
    keep: str | None = OPTIONS["keep"],
    reuse_from: list[str] | None = OPTIONS["reuse"],
    config: str | None = OPTIONS["config"],
    set_: list[str] | None = SetOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
):
    """Ablation grid: cells = arms x seeds, each an online run plus a final evaluation."""
    flags = {
        "env": env,
        "algo": algo,
        "sources": sources,
        "granularity": granularity,
        "placement": placement,
        "seeds": seeds,
        "iterations": iterations,
        "episodes": episodes,
    }
    defines_grid = bool(config or set_ or any(v is not None for v in flags.values()))
    if _without_grid(grid_file, out, cell, report, keep, reuse_from, quiet, defines_grid=defines_grid):
        return
    out_dir = Path(out or "runs/ablate")
    how = Runners(emit, parallel, max_parallel, slurm_template)
    record = _grid_record(grid_file, flags, config, set_, out_dir, cell, how, quiet)
    if record is None:  # a cell of the started ablation ran, as OUT/grid.json records it
        return
    _run_grid(record, out_dir, cell, how, reuse_from or [], quiet)


def _run_grid(record: dict, out_dir: Path, cell: int | None, how: Runners, reuse_from: list[str], quiet: bool) -> None:
    """Record the grid in OUT/grid.json and copy the ``--reuse`` cells; then emit the job array, run
    one cell, or run every cell here and report."""
    if cell is not None:
        cells.select_cell(record, cell)  # range check before anything is written
    from serl_cli.training.backends import is_main_process  # the grid is checked: torch may load now

    main = is_main_process()  # under torchrun (a cell on several GPUs) rank 0 keeps the books
    log = (lambda msg: None) if quiet or not main else (lambda msg: console.print(msg, highlight=False))
    if main:
        write_grid(out_dir, record)
        _reuse(reuse_from, out_dir, log)
    if how.emit == "slurm":
        _emit_slurm(record, out_dir, how)
    elif cell is not None:
        _run_one_cell(record, out_dir, cell, quiet)
    else:
        try:
            runners.run_cells(record, out_dir, parallel=how.parallel, log=log)
        except runners.CellsStopped as e:  # the cells checkpointed and ended; a rerun resumes them
            err_console.print(f"[yellow]stopped:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None
        _report(out_dir, quiet)


@dataclasses.dataclass(frozen=True)
class Runners:
    """How the cells run: here, ``parallel`` at a time, or (``emit`` slurm) as a SLURM job array
    from ``template``, ``max_parallel`` tasks at once."""

    emit: str | None
    parallel: int
    max_parallel: int | None
    template: str | None

    def check(self) -> None:
        if self.emit is not None and self.emit != "slurm":
            raise SerlError(f"unknown --emit {self.emit!r}: choose slurm")
        if self.parallel < 1:
            raise SerlError(f"--parallel must be at least 1, got {self.parallel}")
        if self.max_parallel is not None and self.max_parallel < 1:
            raise SerlError(f"--max-parallel must be at least 1, got {self.max_parallel}")

    @property
    def array_cap(self) -> int:
        """The job array's %N (0: no cap): --max-parallel, else --parallel where it is above 1."""
        return self.max_parallel or (self.parallel if self.parallel > 1 else 0)


def _without_grid(grid_file, out, cell, report, keep, reuse_from, quiet: bool, *, defines_grid: bool) -> bool:
    """Do what needs no grid read (the report of an ablation directory, a cell as OUT/grid.json
    records it) and say whether that was all; refuse, in one line, options that do not go together."""
    if keep is not None and not report:
        raise SerlError("--keep goes with --report: serl ablate --report OUT --keep DIR")
    if reuse_from and report:
        raise SerlError("--reuse goes with a run of the grid, not with --report")
    if report and out is None and grid_file and not Path(grid_file).is_file() and not defines_grid:
        _report(Path(grid_file), quiet, keep)  # serl ablate --report OUT
        return True
    if report and grid_file is None and not defines_grid:
        if out is None:
            raise SerlError("--report needs the ablation directory: serl ablate --report OUT")
        _report(Path(out), quiet, keep)
        return True
    if cell is not None and grid_file is None and not defines_grid:
        # the grid as the ablation directory recorded it: what every runner's cell command reads,
        # so editing the grid file while the cells run changes none of them
        out_dir = Path(out or "runs/ablate")
        _run_one_cell(load_grid_record(out_dir), out_dir, cell, quiet)
        return True
    return False


def _grid_record(grid_file, flags: dict, config, overrides, out_dir: Path, cell, how: Runners, quiet: bool):
    """The grid's record (OUT/grid.json) from the grid file, flags, ``--config`` and ``--set``. A cell
    of an ablation that has started (not under --emit) runs from OUT/grid.json instead, as the
    runners' cells do, where the grid file is gone, cannot be read or has changed since: an edit of
    it changes none of its cells. Then None."""
    started = cell is not None and how.emit is None and (out_dir / "grid.json").is_file()
    what = grid_file or "the grid"
    if grid_file is not None and not Path(grid_file).is_file():
        if started:
            _run_recorded_cell(out_dir, cell, quiet, f"grid file {grid_file} is gone")
            return None
        raise SerlError(f"grid file not found: {grid_file}")
    how.check()
    try:
        grid = ab.load_grid(grid_file, config_file=config, overrides=list(overrides or []), flags=flags)
    except SerlError as e:
        if not started:
            raise
        _run_recorded_cell(out_dir, cell, quiet, f"{what} cannot be read now ({e})")
        return None
    record = grid_record(grid, _source_args(grid_file, flags, config, overrides))
    if started and not same_grid(load_grid_record(out_dir), record):
        _run_recorded_cell(out_dir, cell, quiet, f"{what} has changed since the ablation started")
        return None
    return record


def _source_args(grid_file: str | None, flags: dict, config: str | None, overrides: list[str] | None) -> list[str]:
    """The command line that defines the grid, as OUT/grid.json records it (paths made absolute)."""
    args: list[str] = [str(Path(grid_file).resolve())] if grid_file else []
    for name, value in flags.items():
        if value is not None:
            args += [f"--{name}", str(value)]
    if config:
        args += ["--config", str(Path(config).resolve())]
    for s in overrides or []:
        args += ["--set", s]
    return args


def _reuse(sources: list[str], out_dir: Path, log) -> None:
    """``--reuse``: copy the cells each other ablation directory finished that are this grid's."""
    for src in sources:
        copied, other_start = reuse.reuse_finished_cells(src, out_dir)
        log(f"{copied} finished cells reused from {src}")
        if other_start:
            err_console.print(
                f"{len(other_start)} cells of {src} not reused: they started from another model than "
                f"this grid's (or did not record theirs), e.g. {other_start[0]}",
                highlight=False,
                soft_wrap=True,
            )


def _emit_slurm(record: dict, out_dir: Path, how: Runners) -> None:
    """``--emit slurm``: the job array and its submit script, and a note of the resources it asks
    for where the grid sets none."""
    path = runners.emit_slurm(record, out_dir, template=how.template, parallel=how.array_cap)
    filled = runners.default_resources(record)
    if filled and not (how.template or (record.get("slurm") or {}).get("template")):
        asked = ", ".join(f"--{k.replace('_', '-')}={v}" for k, v in filled.items())
        err_console.print(
            f"note: the grid's slurm: section sets no {', '.join(filled)}: each task asks for {asked} "
            f"(set slurm.{next(iter(filled))} and the others in the grid to change them)",
            highlight=False,
            soft_wrap=True,
        )
    console.print(
        f"{len(record['cells'])} cells; job array written to {path}; submit it with its report job: "
        f"bash {out_dir.resolve() / 'submit.sh'} (or sbatch {path} alone)",
        highlight=False,
    )


def _run_recorded_cell(out_dir: Path, cell: int, quiet: bool, why: str) -> None:
    from serl_cli.training.backends import is_main_process  # torch loads: the cell runs

    if is_main_process():
        err_console.print(
            f"note: {why}: cell {cell} runs as {out_dir / 'grid.json'} records it (to run an edited grid, "
            f"give it another --out)",
            highlight=False,
            soft_wrap=True,
        )
    _run_one_cell(load_grid_record(out_dir), out_dir, cell, quiet)


def _run_one_cell(record: dict, out_dir: Path, cell: int, quiet: bool) -> None:
    from serl_cli.online.stop import Preempted
    from serl_cli.training.backends import is_main_process

    main = is_main_process()
    log = (lambda msg: None) if quiet or not main else (lambda msg: console.print(msg, highlight=False))
    try:
        cells.run_cell(record, out_dir, cell, log=log)
    except Preempted as e:  # SIGTERM/SIGUSR1: checkpointed; rerunning the same command resumes the cell
        if main:
            err_console.print(f"[yellow]preempted:[/] cell {cell}: {e}", highlight=False, soft_wrap=True)
        raise typer.Exit(PREEMPTED_EXIT) from None
