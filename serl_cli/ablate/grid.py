"""``serl ablate``: a grid of online runs (cells), each trained then evaluated in its own directory.

Grid file (YAML; unknown keys anywhere are errors)::

    description: free text                  # optional
    base_config: ../webshop/paper/serl.yaml # optional: run config(s) (a path or a list, relative to this file)
                                            # the base starts from, merged left to right; base: then overrides
    base: {...}                             # an OnlineConfig mapping (env, model, iterations, rollout,
                                            # train, annotate, ...)
    grid:                                   # the axes; each one a list (seeds: a count or a list)
      env: [webshop]                        # default: [base env.name]
      algo: [grpo, serl]                    # default: [base train.algo]
      sources: ["ref|error", error]         # default: [base annotate.sources]
      granularity: [step]                   # default: [base annotate.granularity]
      placement: [feedback]                 # default: [base annotate.placement]
      seeds: 3                              # 3 = seeds 0, 1, 2; or a list [0, 7, 9]; default 1
    arms:                                   # optional: arms beyond the axes' product, each with its own
      - name: serl-plain-warm-start         # settings; with only arms: and grid: {seeds: N}, these are
        algo: serl                          # all the arms. sources/granularity/placement default to the
        sources: obs                        # base's; set: is merged into the base for this arm's cells
        set: {model: runs/warm_start_plain}
    baseline: sokoban-grpo                  # optional: the arm the report pairs the others with
                                            # (default: the first grpo arm, else the first arm)
    contrasts:                              # optional: paired contrasts the report adds, per seed
      - name: "interaction"                 # sum(plus arms) - sum(minus arms); Holm over the contrasts
        plus: [serl-plain, grpo]            # (serl_cli.ablate.report)
        minus: [grpo-plain, serl]
    final_eval: {episodes: 50, split: test} # the fixed panel every cell is scored on (default: whole split;
                                            # panel: spread takes N tasks evenly spaced, not the first N)
    slurm:                                  # the job array (serl_cli.ablate.runners.emit_slurm), all optional
      partition: gpu                        # account, time, cpus_per_task, mem: the same #SBATCH options
                                            # (unset: time 24:00:00, 4 CPUs and 32G per GPU of the cell)
      nodes: 1                              # nodes per cell
      gpus_per_node: 8                      # GPUs per node per cell (gpus: its older name)
      setup: ["module load cuda", "source /path/venv/bin/activate"]   # lines run before the cell
      launcher: auto                        # auto: torchrun across the cell's GPUs when the backend is
                                            # deepspeed and there are several; torchrun | deepspeed | none
      max_parallel: 4                       # array tasks at once (%4; --max-parallel overrides)
      requeue: true                         # near the time limit: checkpoint, requeue, resume (default true)
      signal_grace_s: 900                   # ... that many seconds before it (SIGUSR1)
      template: FILE                        # your own sbatch, with {array} and {command}
      extra: ["--qos=high"]                 # more #SBATCH lines

**Arms and cells.** Arms are the product env x algo x sources x granularity x placement, in
that order, duplicates dropped, then the ``arms:`` entries (named as given; names must be
unique). The sources, granularity and placement axes apply only to the algorithms that annotate
(serl, rlsd, sdpo: ``algos.registry``, whose needs each arm gets); any other algorithm (grpo, gigpo) gets one
arm per environment, however many values those axes hold -- no duplicate cells. rlsd
always uses placement ``all`` (it is SERL's weights on every turn), so it gets one arm per
source set and granularity. sdpo arms get ``train.distill_coef: 1.0`` where the base leaves
it at 0 (sdpo is that term alone). Cells are arms x seeds, arm-major; the seed sets both
``seed`` and ``train.seed`` of the cell's run. ``base.out`` and ``base.seed`` are ignored.

**Flags shorthand.** Without a grid file, flags build the grid on top of ``--config`` (the
base; default: the OnlineConfig defaults) and ``--set``. ``--sources error,obs,ref`` means
one SERL arm per listed source, one SERL arm with all of them combined (``error,obs,ref``),
and the GRPO baseline: algo defaults to ``[grpo, serl]`` when ``--sources`` is given
without ``--algo``. A single spec (``--sources "ref|error"``) is one arm. ``--algo a,b``,
``--granularity x,y``, ``--placement x,y`` and ``--env a,b`` are comma lists; ``--seeds N``
is seeds 0..N-1. With a grid file, the same flags replace that axis of the file
(``--sources`` then is the plain list, no combined arm added).

**Layout of OUT.** ``grid.json`` (the resolved grid and the cell list in a fixed order, so
``--cell i`` means the same cell from every entry point; written atomically, and a second
entry point with a different grid is refused; what only the report reads -- ``description``,
``baseline``, ``contrasts`` -- is taken from the grid file each time it is given),
``cells/<name>/`` per cell: ``cell.json`` (parameters, status running|done, wall time, teacher
tokens scored, final eval summary, selection-bias summary), ``train/`` (the online run),
``eval.json`` + ``episodes.jsonl`` (final evaluation of ``train/checkpoint`` on the fixed test
panel). A cell writes nowhere else, so any number can run at once. A cell whose cell.json says done and whose eval.json
exists is skipped; otherwise training resumes from its last finished iteration (the online
loop's ``--resume``) and the evaluation is redone if missing.

**Names.** ``<env>-<algo>-<sources>-<granularity>-<placement>-s<seed>`` for annotating
algorithms, ``<env>-<algo>-s<seed>`` otherwise; in sources ``|`` becomes ``_or_`` and ``,``
becomes ``+`` (``webshop-serl-ref_or_error-step-feedback-s0``); any other character
outside ``[A-Za-z0-9._+-]`` becomes ``_``. The arm name is the cell name without ``-s<seed>``.

**Runners.** :func:`run_cells` runs the cells here one after another, or ``parallel`` at a
time as subprocesses each running ``serl ablate --out OUT --cell i``, which reads the grid
from ``OUT/grid.json`` (so an edit to the grid file mid-run changes no cell); :func:`emit_slurm` writes
``OUT/ablate.sbatch``, a job array whose task i runs the same command with ``--cell
"$SLURM_ARRAY_TASK_ID"`` (under torchrun or the deepspeed launcher across the cell's GPUs),
``OUT/report.sbatch`` (``serl ablate --report OUT``) and ``OUT/submit.sh``, which submits the
array and the report as a job that depends on it (``afterany``). The scripts run from the
directory ``serl ablate`` ran in (``#SBATCH --chdir``), and models the grid names by a local
path relative to it are recorded absolute. The program is ``${SERL:-python -m serl_cli}``: the
python of the environment ``slurm.setup`` activates, else the interpreter that wrote the script
(by its absolute path); ``SERL=... sbatch OUT/ablate.sbatch`` points it elsewhere.

**--set.** A path is the grid file's: ``--set base.iterations=30`` sets the base's
``iterations`` (every cell; ``--set iterations=30`` is the same: a path outside the grid file's
sections is the base's, as ``--config`` is), ``--set grid.seeds=5``, ``--set
slurm.partition=gpu``, ``--set final_eval.episodes=20`` the grid file's other sections.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path

from serl_cli import config as cfgmod
from serl_cli.ablate.grid_checks import (
    ARM_AXES,
    AXES,
    axis_list,
    check_arm_settings,
    checked_contrasts,
    checked_final_eval,
    checked_grid,
    checked_slurm,
    fail_unknown,
    seed_list,
)
from serl_cli.algos.registry import apply_algorithm, objective
from serl_cli.artifacts import io
from serl_cli.config import setting
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.training.train_config import TrainConfig

TOP_KEYS = ("description", "base_config", "base", "grid", "arms", "baseline", "contrasts", "final_eval", "slurm")
ARM_KEYS = ("name", "env", "algo", "sources", "granularity", "placement", "set")


@dataclass
class Grid:
    """A grid, resolved (``OUT/grid.json`` holds it): built by :func:`load_grid` from a grid file
    (the module docstring) and flags, not loaded key by key."""

    base: dict = setting(doc="the OnlineConfig every cell starts from, resolved (out and seed left out)")
    axes: dict = setting(doc="env, algo, sources, granularity, placement: lists; seeds: a list of ints")
    final_eval: dict = setting(
        factory=lambda: {"episodes": None, "split": None},
        doc="the panel every cell's final policy is scored on: episodes, split (null: the environment's "
        "evaluation split), panel",
    )
    slurm: dict = setting(factory=dict, doc="the job array's settings (ablate.runners.emit_slurm)")
    description: str = setting("", "free text")
    extra_arms: list = setting(factory=list, doc="the grid file's arms: list, resolved (see _explicit_arms)")
    product: bool = setting(True, "whether the axes' product makes arms (not when only arms: and seeds are given)")
    baseline: str | None = setting(None, "the arm the report pairs the others with; null: the first grpo arm")
    contrasts: list = setting(factory=list, doc="[{name, plus: [arms], minus: [arms]}]: the report's contrasts")


# the grid file's sections a --set path may start with (base.iterations=30, grid.seeds=5,
# slurm.partition=gpu); any other path is the base's (iterations=30), as --config is
GRID_FILE_SECTIONS = tuple(k for k in TOP_KEYS if k not in ("base", "base_config"))


def split_overrides(overrides: list[str]) -> tuple[list[str], list[str]]:
    """``--set`` of ``serl ablate`` as (paths into the grid file, paths into the base). A path is
    the grid file's own: ``base.X`` is the base's ``X`` (the same as ``X`` alone, which names the
    online loop's settings as ``--config`` does), ``grid.``/``slurm.``/``final_eval.``... the
    grid file's other sections."""
    on_file, on_base = [], []
    for text in overrides:
        path, _ = cfgmod.parse_override(text)
        if path[0] == "base" and len(path) > 1:
            on_base.append(text.split(".", 1)[1])
        elif path[0] in GRID_FILE_SECTIONS:
            on_file.append(text)
        else:
            on_base.append(text)
    return on_file, on_base


def load_grid(
    path: str | None = None,
    *,
    config_file: str | None = None,
    overrides: list[str] | None = None,
    flags: dict | None = None,
) -> Grid:
    """Build the grid from a grid file and/or flags (see the module docstring for the rule). Each
    phase checks what it reads, in the order below: of two mistakes, the error names the first."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}

    # 1. the grid file, with the --set paths into its own sections; the other paths are the base's
    data, base_overrides = _read_grid_file(path, list(overrides or []))

    # 2. the base every cell starts from, resolved: unknown keys and bad types fail before any arm
    base = _resolve_base(data, path, config_file, base_overrides, flags.pop("iterations", None))

    # 3. the axes: the grid file's (an axis it leaves out holds the base's value), then the flags'
    given_axes = checked_grid(data.get("grid"))
    axes = _flag_axes(_file_axes(given_axes, base), flags, shorthand=not path)

    # 4. the fixed panel every cell is scored on, and the job array's settings
    final_eval = checked_final_eval(data.get("final_eval"), flags.get("episodes"))
    slurm = checked_slurm(data.get("slurm"))

    # 5. the arms: the grid file's own, and the axes' product unless only arms: and seeds were given
    explicit = _explicit_arms(data.get("arms"), base)
    axis_given = any(k != "seeds" for k in given_axes) or any(k in flags for k in ARM_AXES)
    grid = Grid(
        base=absolute_local_paths(base),
        axes=axes,
        final_eval=final_eval,
        slurm=slurm,
        description=str(data.get("description", "")),
        extra_arms=explicit,
        product=axis_given or not explicit,
    )
    check_arm_settings(grid.axes, grid.extra_arms, product=grid.product)

    # 6. what the report reads, by the arms' names: the baseline and the contrasts
    names = _arm_names(grid)
    grid.baseline = _baseline(data.get("baseline"), names)
    grid.contrasts = checked_contrasts(data.get("contrasts"), names)
    return grid


def _read_grid_file(path: str | None, overrides: list[str]) -> tuple[dict, list[str]]:
    """The grid file (none: flags alone) with the ``--set`` paths into its sections applied, and
    the ``--set`` paths left for the base. Its own keys are checked before any ``--set`` is read."""
    data: dict = {}
    if path:
        data = cfgmod.load_yaml(path)
        fail_unknown(data, TOP_KEYS, "")
    on_file, on_base = split_overrides(overrides)
    data = cfgmod.apply_overrides(data, on_file)
    fail_unknown(data, TOP_KEYS, "")
    if path and (not isinstance(data.get("grid"), dict) or not data["grid"]):
        raise SerlError(f"empty grid in {path}: give grid: with at least one axis ({', '.join(AXES)})")
    return data, on_base


def _resolve_base(
    data: dict, path: str | None, config_file: str | None, overrides: list[str], iterations: int | None
) -> dict:
    """The OnlineConfig every cell starts from, as plain settings: the grid file's base_config
    then base:, under --config, --set and --iterations. out and seed are each cell's own."""
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise SerlError("base: must be a mapping of online-loop settings")
    if path and data.get("base_config"):
        base = cfgmod.merge(_base_configs(Path(path), data["base_config"]), base)
    if config_file:
        base = cfgmod.merge(base, cfgmod.load_yaml(config_file))
    base = cfgmod.apply_overrides(base, overrides)
    if iterations is not None:
        base = cfgmod.merge(base, {"iterations": iterations})
    from serl_cli.online.config import OnlineConfig

    resolved = cfgmod.from_dict(OnlineConfig, base, "base")  # unknown keys and bad types fail here
    base_plain = io.to_plain(resolved)
    base_plain.pop("out", None)
    base_plain.pop("seed", None)
    return base_plain


def _file_axes(raw: dict, base: dict) -> dict:
    """Every axis as a list: the grid file's, else the base's one value (seeds: 1, seed 0)."""
    annotate = base["annotate"]
    return {
        "env": axis_list(raw.get("env", [base["env"]["name"]]), "env"),
        "algo": axis_list(raw.get("algo", [base["train"]["algo"]]), "algo"),
        "sources": axis_list(raw.get("sources", [annotate["sources"]]), "sources"),
        "granularity": axis_list(raw.get("granularity", [annotate["granularity"]]), "granularity"),
        "placement": axis_list(raw.get("placement", [annotate["placement"]]), "placement"),
        "seeds": seed_list(raw.get("seeds", 1)),
    }


def _flag_axes(axes: dict, flags: dict, *, shorthand: bool) -> dict:
    """``axes`` with each axis a flag gives replaced by the flag's comma list. Without a grid file
    (``shorthand``), ``--sources`` of several adds their combination and, without ``--algo``, the
    GRPO baseline (the module docstring's flags shorthand)."""
    for name in ("env", "algo", "granularity", "placement"):
        if name in flags:
            axes[name] = [v.strip() for v in str(flags[name]).split(",") if v.strip()]
    if "sources" in flags:
        listed = [s.strip() for s in str(flags["sources"]).split(",") if s.strip()]
        if shorthand and len(listed) > 1:
            listed = listed + [",".join(listed)]
        axes["sources"] = listed
        if shorthand and "algo" not in flags:
            axes["algo"] = ["grpo", "serl"]
    if "seeds" in flags:
        axes["seeds"] = seed_list(flags["seeds"])
    for name, values in axes.items():
        if not values:
            raise SerlError(f"empty grid: the {name} axis has no values")
    return axes


def _arm_names(grid: Grid) -> list[str]:
    """The arms' names, each one once: a cell's directory and the report's rows go by them."""
    names = [a["name"] for a in arms(grid)]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SerlError(f"two arms share the name {dup[0]}: give each entry of arms: its own name")
    return names


def _baseline(value, names: list[str]) -> str | None:
    """The grid file's ``baseline:``, made safe as arm names are (None where not given: the report's
    default, the first grpo arm)."""
    if value is None:
        return None
    baseline = _safe(str(value))
    if baseline not in names:
        raise SerlError(f"baseline {value!r} is not an arm of this grid: choose one of {', '.join(names)}")
    return baseline


# the settings that name a model: a local directory or a hub name (Qwen/Qwen2.5-7B-Instruct)
MODEL_PATHS = (("model",), ("annotate", "teacher"), ("train", "model"))


def absolute_local_paths(settings: dict) -> dict:
    """``settings`` with each model that names an existing local path relative to this directory
    made absolute: a cell runs from wherever its runner starts it (a SLURM task, another shell),
    and reads the grid from OUT/grid.json. A hub name, or a path not there yet, is left as it is
    (the job array runs from this directory: ``#SBATCH --chdir``)."""
    out = cfgmod.merge({}, settings)
    for path in MODEL_PATHS:
        node = out
        for key in path[:-1]:
            child = node.get(key)
            node = child if isinstance(child, dict) else {}
        value = node.get(path[-1])
        if isinstance(value, str) and value and not Path(value).is_absolute() and Path(value).exists():
            node[path[-1]] = str(Path(value).resolve())
    return out


def _explicit_arms(value, base: dict) -> list[dict]:
    """The grid file's ``arms:`` list: arms beyond the axes' product, each with its own
    settings (``set:``, merged into the base for its cells), e.g. another warm start or looser
    weight bounds. An arm's sources, granularity and placement default to the base's; the
    models its ``set:`` names locally are made absolute (:func:`absolute_local_paths`)."""
    from serl_cli.online.config import OnlineConfig

    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(a, dict) for a in value):
        raise SerlError("arms: must be a list of mappings, each with a name and an algo")
    out: list[dict] = []
    for i, a in enumerate(value):
        fail_unknown(a, ARM_KEYS, f"arms[{i}].")
        if not a.get("name") or not a.get("algo"):
            raise SerlError(f"arms[{i}] needs a name and an algo")
        overrides = a.get("set") or {}
        if not isinstance(overrides, dict):
            raise SerlError(f"arms[{i}].set must be a mapping of online-loop settings")
        cfgmod.from_dict(OnlineConfig, cfgmod.merge(base, overrides), f"arms[{i}].set")  # unknown keys fail here
        ann = base["annotate"]
        out.append(
            {
                "name": _safe(str(a["name"])),
                "env": str(a.get("env", base["env"]["name"])),
                "algo": str(a["algo"]),
                "sources": str(a.get("sources", ann["sources"])),
                "granularity": str(a.get("granularity", ann["granularity"])),
                "placement": str(a.get("placement", ann["placement"])),
                "set": overrides,
            }
        )
    for arm in out:  # once every arm's settings are checked
        arm["set"] = absolute_local_paths(arm["set"])
    return out


def _base_configs(grid_path: Path, value) -> dict:
    """The run configs a grid's base starts from (``base_config``), merged left to right;
    relative paths are from the grid file's folder, so a grid and its configs move together."""
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, list) or not files or not all(isinstance(f, str) and f for f in files):
        raise SerlError(f"base_config in {grid_path} must be a path or a list of paths, got {value!r}")
    out: dict = {}
    for f in files:
        p = Path(f) if Path(f).is_absolute() else grid_path.parent / f
        out = cfgmod.merge(out, cfgmod.load_yaml(p))
    return out


def _safe(text: str) -> str:
    text = text.replace("|", "_or_").replace(",", "+").replace(" ", "")
    return re.sub(r"[^A-Za-z0-9._+-]", "_", text)


def _feedback_axes(algo: str, sources, gran, place) -> dict:
    """An arm's feedback settings: only the algorithms that annotate have them, and those their
    algorithm needs win (rlsd: placement all, every turn)."""
    if not objective(algo).needs_annotations:
        return {"sources": None, "granularity": None, "placement": None}
    _, annotate = apply_algorithm(TrainConfig(algo=algo), AnnotateConfig(placement=place))
    return {"sources": sources, "granularity": gran, "placement": annotate.placement}


def arms(grid: Grid) -> list[dict]:
    """The product arms (unless only ``arms:`` was given), then the grid file's own arms."""
    out, seen = [], set()
    product = (
        itertools.product(
            grid.axes["env"], grid.axes["algo"], grid.axes["sources"], grid.axes["granularity"], grid.axes["placement"]
        )
        if grid.product
        else []
    )
    for env, algo, sources, gran, place in product:
        arm = {"env": env, "algo": algo, **_feedback_axes(algo, sources, gran, place)}
        parts = (env, algo, sources, gran, arm["placement"]) if objective(algo).needs_annotations else (env, algo)
        name = "-".join(_safe(x) for x in parts)
        if name in seen:
            continue
        seen.add(name)
        out.append({"name": name, **arm})
    for arm in grid.extra_arms:
        out.append({**arm, **_feedback_axes(arm["algo"], arm["sources"], arm["granularity"], arm["placement"])})
    return out


def cell_overrides(grid: Grid, arm: dict, seed: int) -> dict:
    """What a cell changes in the base config (out is set at run time)."""
    o: dict = {"env": {"name": arm["env"]}, "train": {"algo": arm["algo"], "seed": seed}, "seed": seed}
    if objective(arm["algo"]).needs_annotations:
        o["annotate"] = {"sources": arm["sources"], "granularity": arm["granularity"], "placement": arm["placement"]}
    # the train settings the algorithm takes by default where the base leaves them (sdpo: distill_coef 1)
    given = cfgmod.from_dict(
        TrainConfig, cfgmod.merge(cfgmod.merge(grid.base, arm.get("set") or {})["train"], o["train"])
    )
    applied, _ = apply_algorithm(given)
    o["train"].update({k: v for k, v in io.to_plain(applied).items() if v != io.to_plain(given)[k]})
    return cfgmod.merge(arm["set"], o) if arm.get("set") else o


def cells(grid: Grid) -> list[dict]:
    out: list[dict] = []
    for arm in arms(grid):
        for seed in grid.axes["seeds"]:
            out.append(
                {
                    "index": len(out),
                    "name": f"{arm['name']}-s{seed}",
                    "arm": arm["name"],
                    "seed": seed,
                    "params": {k: arm[k] for k in ("env", "algo", "sources", "granularity", "placement")},
                    "overrides": cell_overrides(grid, arm, seed),
                }
            )
    return out
