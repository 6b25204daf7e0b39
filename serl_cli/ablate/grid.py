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
from serl_cli.algos.registry import apply_algorithm, objective
from serl_cli.artifacts import io
from serl_cli.config import setting
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig, validate
from serl_cli.training.train_config import TrainConfig

AXES = ("env", "algo", "sources", "granularity", "placement", "seeds")
TOP_KEYS = ("description", "base_config", "base", "grid", "arms", "baseline", "contrasts", "final_eval", "slurm")
CONTRAST_KEYS = ("name", "plus", "minus")
ARM_KEYS = ("name", "env", "algo", "sources", "granularity", "placement", "set")
FINAL_EVAL_KEYS = ("episodes", "split", "panel")
SLURM_KEYS = (
    "partition",
    "account",
    "time",
    "nodes",
    "gpus_per_node",
    "gpus",
    "cpus_per_task",
    "mem",
    "setup",
    "launcher",
    "max_parallel",
    "requeue",
    "signal_grace_s",
    "template",
    "extra",
)
LAUNCHERS = ("auto", "torchrun", "deepspeed", "none")


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


def _fail_unknown(keys, known, where: str) -> None:
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise SerlError(f"unknown key {where}{unknown[0]} in the ablation grid (known: {', '.join(known)})")


def _as_list(value, name: str) -> list:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",")] if name != "sources" else [value]
    if not isinstance(value, list):
        raise SerlError(f"grid.{name} must be a list, got {value!r}")
    return [str(v) for v in value]


def _seeds(value) -> list[int]:
    if isinstance(value, bool):
        raise SerlError(f"grid.seeds must be a count or a list of integers, got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise SerlError(f"empty grid: grid.seeds is {value}; give a count of at least 1 or a list of seeds")
        return list(range(value))
    if isinstance(value, list) and all(isinstance(s, int) and not isinstance(s, bool) for s in value):
        if len(set(value)) != len(value):
            raise SerlError(f"grid.seeds names a seed twice: {value}")
        return list(value)
    raise SerlError(f"grid.seeds must be a count or a list of integers, got {value!r}")


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
    """Build the grid from a grid file and/or flags (see the module docstring for the rule)."""
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    data: dict = {}
    if path:
        data = cfgmod.load_yaml(path)
        _fail_unknown(data, TOP_KEYS, "")
    on_file, overrides = split_overrides(list(overrides or []))
    data = cfgmod.apply_overrides(data, on_file)
    _fail_unknown(data, TOP_KEYS, "")
    if path and (not isinstance(data.get("grid"), dict) or not data["grid"]):
        raise SerlError(f"empty grid in {path}: give grid: with at least one axis ({', '.join(AXES)})")
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise SerlError("base: must be a mapping of online-loop settings")
    if path and data.get("base_config"):
        base = cfgmod.merge(_base_configs(Path(path), data["base_config"]), base)
    if config_file:
        base = cfgmod.merge(base, cfgmod.load_yaml(config_file))
    base = cfgmod.apply_overrides(base, overrides)
    if "iterations" in flags:
        base = cfgmod.merge(base, {"iterations": flags.pop("iterations")})
    from serl_cli.online.config import OnlineConfig

    resolved = cfgmod.from_dict(OnlineConfig, base, "base")  # unknown keys and bad types fail here
    base_plain = io.to_plain(resolved)
    base_plain.pop("out", None)
    base_plain.pop("seed", None)

    raw = dict(data.get("grid") or {})
    _fail_unknown(raw, AXES, "grid.")
    for key, value in raw.items():
        if value is None or value == [] or value == "":
            raise SerlError(f"empty grid: grid.{key} has no values")
    axes = {
        "env": _as_list(raw.get("env", [base_plain["env"]["name"]]), "env"),
        "algo": _as_list(raw.get("algo", [base_plain["train"]["algo"]]), "algo"),
        "sources": _as_list(raw.get("sources", [base_plain["annotate"]["sources"]]), "sources"),
        "granularity": _as_list(raw.get("granularity", [base_plain["annotate"]["granularity"]]), "granularity"),
        "placement": _as_list(raw.get("placement", [base_plain["annotate"]["placement"]]), "placement"),
        "seeds": _seeds(raw.get("seeds", 1)),
    }
    # flags replace axes; --sources from flags alone is the shorthand (each, all, + grpo)
    for name in ("env", "algo", "granularity", "placement"):
        if name in flags:
            axes[name] = [v.strip() for v in str(flags[name]).split(",") if v.strip()]
    if "sources" in flags:
        listed = [s.strip() for s in str(flags["sources"]).split(",") if s.strip()]
        if not path and len(listed) > 1:
            listed = listed + [",".join(listed)]
        axes["sources"] = listed
        if not path and "algo" not in flags:
            axes["algo"] = ["grpo", "serl"]
    if "seeds" in flags:
        axes["seeds"] = _seeds(flags["seeds"])
    for name, values in axes.items():
        if not values:
            raise SerlError(f"empty grid: the {name} axis has no values")

    fe = data.get("final_eval") or {}
    if not isinstance(fe, dict):
        raise SerlError("final_eval: must be a mapping {episodes, split, panel}")
    _fail_unknown(fe, FINAL_EVAL_KEYS, "final_eval.")
    final_eval = {"episodes": fe.get("episodes"), "split": None if fe.get("split") is None else str(fe["split"])}
    if "panel" in fe:  # absent means "first", so grids written before panels existed stay the same grid
        from serl_cli.stages.evaluate import PANELS

        final_eval["panel"] = str(fe["panel"])
        if final_eval["panel"] not in PANELS:
            raise SerlError(f"final_eval.panel {final_eval['panel']!r} is unknown: choose one of {', '.join(PANELS)}")
    if "episodes" in flags:
        final_eval["episodes"] = flags["episodes"]
    if final_eval["episodes"] is not None and (
        not isinstance(final_eval["episodes"], int) or final_eval["episodes"] < 1
    ):
        raise SerlError(f"final_eval.episodes must be a positive integer, got {final_eval['episodes']!r}")
    slurm = data.get("slurm") or {}
    if not isinstance(slurm, dict):
        raise SerlError("slurm: must be a mapping")
    _fail_unknown(slurm, SLURM_KEYS, "slurm.")
    _check_slurm(slurm)
    explicit = _explicit_arms(data.get("arms"), base_plain, OnlineConfig)
    for arm in explicit:
        arm["set"] = absolute_local_paths(arm["set"])
    axis_given = any(k != "seeds" for k in raw) or any(
        k in flags for k in ("env", "algo", "sources", "granularity", "placement")
    )
    grid = Grid(
        base=absolute_local_paths(base_plain),
        axes=axes,
        final_eval=final_eval,
        slurm=slurm,
        description=str(data.get("description", "")),
        extra_arms=explicit,
        product=axis_given or not explicit,
    )
    _validate_axes(grid)
    names = [a["name"] for a in arms(grid)]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise SerlError(f"two arms share the name {dup[0]}: give each entry of arms: its own name")
    if data.get("baseline") is not None:
        grid.baseline = _safe(str(data["baseline"]))
        if grid.baseline not in names:
            raise SerlError(
                f"baseline {data['baseline']!r} is not an arm of this grid: choose one of {', '.join(names)}"
            )
    grid.contrasts = _contrasts(data.get("contrasts"), names)
    return grid


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


def _contrasts(value, names: list[str]) -> list[dict]:
    """The grid file's ``contrasts:``, checked: each a name, plus arms (at least one) and minus arms, all
    arms of this grid (an arm may repeat: ``minus: [grpo, grpo]`` counts it twice)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise SerlError("contrasts: must be a list of {name, plus: [arms], minus: [arms]}")
    out: list[dict] = []
    for i, con in enumerate(value):
        if not isinstance(con, dict):
            raise SerlError(f"contrasts[{i}] must be a mapping {{name, plus, minus}}")
        _fail_unknown(con, CONTRAST_KEYS, f"contrasts[{i}].")
        if not con.get("name"):
            raise SerlError(f"contrasts[{i}] needs a name")
        name = str(con["name"])
        sides = {}
        for side in ("plus", "minus"):
            arms_ = con.get(side) or []
            if not isinstance(arms_, list):
                raise SerlError(f"contrast {name!r}: {side} must be a list of arm names")
            for arm in map(str, arms_):
                if arm not in names:
                    raise SerlError(
                        f"contrast {name!r} names arm {arm!r}, which is not an arm of this grid: "
                        f"choose among {', '.join(names)}"
                    )
            sides[side] = [str(a) for a in arms_]
        if not sides["plus"]:
            raise SerlError(f"contrast {name!r} needs at least one plus arm")
        if any(c["name"] == name for c in out):
            raise SerlError(f"two contrasts are named {name!r}: give each its own name")
        out.append({"name": name, **sides})
    return out


def _explicit_arms(value, base: dict, config_cls) -> list[dict]:
    """The grid file's ``arms:`` list: arms beyond the axes' product, each with its own
    settings (``set:``, merged into the base for its cells), e.g. another warm start or looser
    weight bounds. An arm's sources, granularity and placement default to the base's."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(a, dict) for a in value):
        raise SerlError("arms: must be a list of mappings, each with a name and an algo")
    out = []
    for i, a in enumerate(value):
        _fail_unknown(a, ARM_KEYS, f"arms[{i}].")
        if not a.get("name") or not a.get("algo"):
            raise SerlError(f"arms[{i}] needs a name and an algo")
        overrides = a.get("set") or {}
        if not isinstance(overrides, dict):
            raise SerlError(f"arms[{i}].set must be a mapping of online-loop settings")
        cfgmod.from_dict(config_cls, cfgmod.merge(base, overrides), f"arms[{i}].set")  # unknown keys fail here
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
    return out


# the slurm settings written as `#SBATCH --key=value`, and what such a value may hold: sbatch splits
# the line at whitespace, and a line break would end the directives
SBATCH_WORDS = ("partition", "account", "time", "mem")
SBATCH_WORD = re.compile(r"[A-Za-z0-9._:,+@/=-]+")


def _check_slurm(s: dict) -> None:
    """The ``slurm:`` settings, checked when the grid loads (not when the job starts)."""
    if "gpus" in s and "gpus_per_node" in s:
        raise SerlError("slurm: give gpus_per_node (gpus is its older name), not both")
    for key in ("nodes", "gpus_per_node", "gpus", "cpus_per_task", "max_parallel", "signal_grace_s"):
        v = s.get(key)
        if v is not None and (
            not isinstance(v, int) or isinstance(v, bool) or v < (0 if key in ("gpus", "gpus_per_node") else 1)
        ):
            raise SerlError(f"slurm.{key} must be a positive integer, got {v!r}")
    for key in ("setup", "extra"):
        v = s.get(key)
        if v is not None and not (isinstance(v, list) and all(isinstance(x, str) for x in v)):
            raise SerlError(f"slurm.{key} must be a list of lines, got {v!r}")
    for key in SBATCH_WORDS:  # written into `#SBATCH --key=value`: one word, or sbatch reads another option
        v = s.get(key)
        if v is not None and (not isinstance(v, str | int) or isinstance(v, bool) or not SBATCH_WORD.fullmatch(str(v))):
            raise SerlError(f"slurm.{key} must be one word (letters, digits, and . _ : , + @ / = - only), got {v!r}")
    for key in ("setup", "extra", "template"):  # a line break would add a line of its own to the script
        lines = s.get(key)
        for line in lines if isinstance(lines, list) else [] if lines is None else [lines]:
            if any(c in str(line) for c in "\n\r\x00"):
                raise SerlError(f"slurm.{key} must not hold a line break, got {line!r}")
    if s.get("launcher", "auto") not in LAUNCHERS:
        raise SerlError(f"unknown slurm.launcher {s['launcher']!r}: choose one of {', '.join(LAUNCHERS)}")
    if "requeue" in s and not isinstance(s["requeue"], bool):
        raise SerlError(f"slurm.requeue must be true or false, got {s['requeue']!r}")


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


def _validate_axes(grid: Grid) -> None:
    for arm in grid.extra_arms:
        if objective(arm["algo"]).needs_annotations:
            validate(AnnotateConfig(sources=arm["sources"], granularity=arm["granularity"], placement=arm["placement"]))
    for algo in grid.axes["algo"] if grid.product else []:
        if not objective(algo).online:  # an unknown algorithm: one line naming the known ones
            raise SerlError(
                f"--algo {algo} is not an online algorithm: warm-start with `serl train RUN --algo {algo}` and "
                "give its checkpoint as base.model"
            )
    if any(objective(a).needs_annotations for a in grid.axes["algo"]):
        for s, g, p in itertools.product(grid.axes["sources"], grid.axes["granularity"], grid.axes["placement"]):
            validate(AnnotateConfig(sources=s, granularity=g, placement=p))


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
