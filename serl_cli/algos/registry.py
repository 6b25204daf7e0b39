"""The ``--algo`` registry: what each algorithm needs of the pipeline, and where its math is.

An entry holds everything the stages must know of an algorithm: whether it learns from
annotations, the annotate settings its annotations must have, the train settings it takes
by default, whether it runs online, and which functions of :mod:`serl_cli.algos.objectives`
prepare a batch and give its loss -- by name, so that a config is checked without loading
torch (the functions load for an update, :func:`serl_cli.algos.objectives.get_objective`).

:func:`apply_algorithm` applies an entry's needs; the online loop (``online.derive``),
``serl annotate RUN --algo A`` and the ablation grid all call it, and an update refuses
annotations that do not meet them (:func:`check_annotations`). Adding an algorithm is one
entry here, and its math in ``objectives.py`` where it brings new math.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from serl_cli.errors import SerlError

# the words of the train settings the objectives read (TrainConfig types its fields with them)
GroupNorm = Literal["episode", "cross_steps"]
GigpoMode = Literal["mean_std_norm", "mean_norm"]
# what makes turns one GiGPO anchor state: the environment's state_key | the raw observation (the authors')
GigpoAnchor = Literal["state", "observation"]
GROUP_NORMS, GIGPO_MODES, GIGPO_ANCHORS = get_args(GroupNorm), get_args(GigpoMode), get_args(GigpoAnchor)


@dataclass(frozen=True)
class Objective:
    name: str
    prepare: str | Callable  # (turns, UpdateInputs, train config) -> PerTurn: a function of algos.objectives, by name
    loss: str | Callable = "policy_gradient_loss"  # (micro-batch, log-probs, train config, ...) -> (loss, stats)
    uses_behaviour_logprobs: bool = True  # False: stored turns need no log-probs (SFT on expert data)
    needs_annotations: bool = False  # learns from `serl annotate`'s records (the loop annotates before the update)
    online: bool = True  # False: not an online algorithm (sft: a warm start from expert data)
    # clones the stored replies: trained at temperature 1 whatever sampled them; train.sft_successful_only
    # and train.hindsight_sft apply to it
    imitation: bool = False
    baseline: bool = False  # the ablation report's baseline arm when the grid names none
    # its direction is the group-normalized advantage: a group of one has advantage 0, nothing to learn
    group_relative: bool = True
    annotate: Mapping = field(default_factory=dict)  # the annotate settings its annotations must have
    train_defaults: Mapping = field(default_factory=dict)  # train settings it takes where the run leaves the default


OBJECTIVES: dict[str, Objective] = {}


def register(obj: Objective) -> Objective:
    OBJECTIVES[obj.name] = obj
    return obj


register(
    Objective(
        "sft",
        "sft_prepare",
        "sft_loss",
        uses_behaviour_logprobs=False,
        online=False,
        imitation=True,
        group_relative=False,
    )
)
register(Objective("grpo", "grpo_prepare", baseline=True))
register(Objective("gigpo", "gigpo_prepare"))
register(Objective("serl", "weighted_prepare", needs_annotations=True))
# SERL's weights on every turn with a block, and on every reply token, reasoning included (METHOD.md 7)
register(
    Objective("rlsd", "weighted_prepare", needs_annotations=True, annotate={"placement": "all", "tokens": "reply"})
)
# the distillation term alone, on failed rollouts whatever their advantage
register(
    Objective(
        "sdpo",
        "sdpo_prepare",
        needs_annotations=True,
        annotate={"skip_zero_advantage": False},
        train_defaults={"distill_coef": 1.0},
        group_relative=False,
    )
)


def objective(name: str) -> Objective:
    if name not in OBJECTIVES:
        raise SerlError(f"unknown algorithm {name!r}: choose one of {', '.join(sorted(OBJECTIVES))}")
    return OBJECTIVES[name]


def check_group_size(algo: str, group_size: int) -> None:
    """A group-relative algorithm on groups of one: every advantage is 0, so every update would
    change nothing however long it ran. Refused rather than run."""
    if objective(algo).group_relative and group_size < 2:
        raise SerlError(
            f"--algo {algo} compares the rollouts of a task's group, and --group-size {group_size} gives every "
            "advantage 0 (no update would change anything): use --group-size 2 or more"
        )


def annotate_needs(train) -> dict:
    """The annotate settings ``train.algo``'s annotations must have: its entry's, and under any
    ``train.distill_coef`` the teacher on zero-advantage turns too (the distillation term wants
    the teacher's log-probs on failed rollouts whatever their advantage)."""
    needs = dict(objective(train.algo).annotate)
    if train.distill_coef:
        needs["skip_zero_advantage"] = False
    return needs


def apply_algorithm(train, annotate=None):
    """``(train, annotate)`` as ``train.algo`` runs them: its default train settings where
    ``train`` leaves a setting at the field's default, then the annotate settings it needs
    (:func:`annotate_needs`) forced onto ``annotate`` (None: none given). Copies; the inputs
    are left as they are."""
    defaults = {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in dataclasses.fields(train)
    }
    own = {k: v for k, v in objective(train.algo).train_defaults.items() if getattr(train, k) == defaults[k]}
    train = dataclasses.replace(train, **own)
    if annotate is not None:
        annotate = dataclasses.replace(annotate, **annotate_needs(train))
    return train, annotate


def check_annotations(train, made: Mapping) -> None:
    """Refuse annotations made (``made``: their recorded annotate settings) without a setting
    ``train.algo`` needs; a setting they do not record is not checked (older annotations)."""
    for key, want in annotate_needs(train).items():
        if key in made and made[key] != want:
            raise SerlError(
                f"--algo {train.algo} needs annotations made with {key}={json.dumps(want)}, these have "
                f"{json.dumps(made[key])}: annotate again with `serl annotate RUN --algo {train.algo}` and the "
                f"same train settings (--config RUN_FILE, --set train.KEY=VALUE)"
            )
