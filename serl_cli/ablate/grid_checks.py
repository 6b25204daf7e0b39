"""The ablation grid file's sections checked as it loads: the keys, ``grid:``, ``final_eval:``,
``slurm:``, ``contrasts:``, and the algorithm and feedback settings of every arm.

Apart from the grid's parser (:mod:`serl_cli.ablate.grid`, whose docstring has the grid file's
layout): each ``checked_*`` function takes one section as the file (and ``--set``) wrote it and
returns it checked, or raises one line naming the key at fault -- when the grid loads, not when a
cell or the job array starts.
"""

from __future__ import annotations

import itertools
import re

from serl_cli.algos.registry import objective
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig, validate

ARM_AXES = ("env", "algo", "sources", "granularity", "placement")  # their product makes the arms
AXES = (*ARM_AXES, "seeds")  # ... and with the seeds, the cells
CONTRAST_KEYS = ("name", "plus", "minus")
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

# the slurm settings written as `#SBATCH --key=value`, and what such a value may hold: sbatch splits
# the line at whitespace, and a line break would end the directives
SBATCH_WORDS = ("partition", "account", "time", "mem")
SBATCH_WORD = re.compile(r"[A-Za-z0-9._:,+@/=-]+")


def fail_unknown(keys, known, where: str) -> None:
    """Unknown keys anywhere in a grid file are errors: a typo must not silently run the default."""
    unknown = sorted(set(keys) - set(known))
    if unknown:
        raise SerlError(f"unknown key {where}{unknown[0]} in the ablation grid (known: {', '.join(known)})")


def checked_grid(value) -> dict:
    """The axes the grid file's ``grid:`` names, as written; each one given must hold a value."""
    raw = dict(value or {})
    fail_unknown(raw, AXES, "grid.")
    for key, values in raw.items():
        if values is None or values == [] or values == "":
            raise SerlError(f"empty grid: grid.{key} has no values")
    return raw


def axis_list(value, name: str) -> list:
    """An axis's values as a list of words: a string is a comma list, but a sources string is one
    spec (its commas combine sources: ``error,obs``)."""
    if isinstance(value, str):
        return [v.strip() for v in value.split(",")] if name != "sources" else [value]
    if not isinstance(value, list):
        raise SerlError(f"grid.{name} must be a list, got {value!r}")
    return [str(v) for v in value]


def seed_list(value) -> list[int]:
    """``grid.seeds`` (or ``--seeds``): a count N (seeds 0..N-1) or a list of distinct integers."""
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


def check_arm_settings(axes: dict, extra_arms: list[dict], *, product: bool) -> None:
    """Every arm's algorithm runs online, and each annotating arm's sources, granularity and
    placement are valid (the axes' every combination, where any algorithm on them annotates)."""
    for arm in extra_arms:
        if objective(arm["algo"]).needs_annotations:
            validate(AnnotateConfig(sources=arm["sources"], granularity=arm["granularity"], placement=arm["placement"]))
    for algo in axes["algo"] if product else []:
        if not objective(algo).online:  # an unknown algorithm: one line naming the known ones
            raise SerlError(
                f"--algo {algo} is not an online algorithm: warm-start with `serl train RUN --algo {algo}` and "
                "give its checkpoint as base.model"
            )
    if any(objective(a).needs_annotations for a in axes["algo"]):
        for s, g, p in itertools.product(axes["sources"], axes["granularity"], axes["placement"]):
            validate(AnnotateConfig(sources=s, granularity=g, placement=p))


def checked_final_eval(value, episodes: int | None) -> dict:
    """The grid file's ``final_eval:`` as the panel every cell is scored on; ``episodes`` (the
    ``--episodes`` flag, None where not given) replaces its count."""
    fe = value or {}
    if not isinstance(fe, dict):
        raise SerlError("final_eval: must be a mapping {episodes, split, panel}")
    fail_unknown(fe, FINAL_EVAL_KEYS, "final_eval.")
    final_eval = {"episodes": fe.get("episodes"), "split": None if fe.get("split") is None else str(fe["split"])}
    if "panel" in fe:  # absent means "first", so grids written before panels existed stay the same grid
        from serl_cli.stages.evaluate import PANELS

        final_eval["panel"] = str(fe["panel"])
        if final_eval["panel"] not in PANELS:
            raise SerlError(f"final_eval.panel {final_eval['panel']!r} is unknown: choose one of {', '.join(PANELS)}")
    if episodes is not None:
        final_eval["episodes"] = episodes
    if final_eval["episodes"] is not None and (
        not isinstance(final_eval["episodes"], int) or final_eval["episodes"] < 1
    ):
        raise SerlError(f"final_eval.episodes must be a positive integer, got {final_eval['episodes']!r}")
    return final_eval


def checked_slurm(value) -> dict:
    """The grid file's ``slurm:``, its keys and their values (:func:`check_slurm`)."""
    slurm = value or {}
    if not isinstance(slurm, dict):
        raise SerlError("slurm: must be a mapping")
    fail_unknown(slurm, SLURM_KEYS, "slurm.")
    check_slurm(slurm)
    return slurm


def check_slurm(s: dict) -> None:
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


def checked_contrasts(value, names: list[str]) -> list[dict]:
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
        fail_unknown(con, CONTRAST_KEYS, f"contrasts[{i}].")
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
