"""``AnnotateConfig``, the ``annotate`` settings of a run, and their checks.

Apart from the annotation itself (:mod:`serl_cli.method.annotation`, which runs the teacher)
so that a config loads and is checked without torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from serl_cli import config as cfgmod
from serl_cli.config import at_least, setting, within
from serl_cli.method import feedback as fb
from serl_cli.method import placement
from serl_cli.models.choices import Device, Dtype

Granularity = Literal["step", "anchor"]
Tokens = Literal["action", "reply"]
Unparsed = Literal["none", "whole"]
# which characters are the action: last = the executed one by serl's parse (the last closed <action> tag, or a
# bare action) | authors = every tagged span, malformed tags included, else search[...]/click[...] anywhere
ActionSpans = Literal["last", "authors"]
# how ref, expert and shuffled render: the whole trajectory as "Step k" lines | only this state's action
# (method.feedback): a prompt with no history cannot tell which line of a trajectory is "now"
Trajectory = Literal["full", "aligned"]
GRANULARITIES = get_args(Granularity)


@dataclass
class AnnotateConfig:
    sources: str = setting(
        "obs",
        "feedback sources: error, diff, obs, future, ref, expert (privileged oracle), shuffled (the oracle's "
        "block naming random other moves: its control; Sokoban); ',' combines, '|' falls back (e.g. 'ref|error'; "
        "METHOD.md 3). obs = the environment's raw answer, the authors' default mode immediate_feedback "
        "(serl_trainer.yaml:47, run_webshop.sh:22, run_alfworld.sh)",
    )
    trajectory: Trajectory = setting(
        "full",
        "ref, expert and shuffled: full (the whole trajectory as 'Step k' lines) | aligned (only this state's "
        "action: a prompt with no history cannot tell which line of a trajectory is now)",
    )
    granularity: Granularity = setting("step", "step | anchor")
    placement: str = setting(
        "all", "all (every turn with a block: the authors') | feedback | gap | random (serl's extension)"
    )
    rho: float = setting(0.25, "gap: fraction of turns selected")
    anchor_similarity: float | None = setting(
        None, "anchor: also pool observations at least this similar", limit=within(0, 1, "in [0, 1] (or unset)")
    )
    max_hindsight_tokens: int = setting(
        2048,
        "the whole block's cap, in tokens of the policy's tokenizer, cut cleanly from the end: 2048, the "
        "authors' ALFWorld max_reprompt_len (run_alfworld.sh:83), here for the block alone (see README)",
        limit=at_least(1, "a positive number of tokens", whole=True),
    )
    tokens: Tokens = setting("action", "action: the parsed action's tokens (serl) | reply: every reply token (rlsd)")
    unparsed: Unparsed = setting(
        "none", "a reply with no parseable action: none = no weights (the authors') | whole = all of it"
    )
    action_spans: ActionSpans = setting(
        "last",
        "which characters are the action: last = the executed one by serl's parse (the last closed <action> "
        "tag, or a bare action) | authors = every tagged span, malformed tags included, else search[...]/"
        "click[...] anywhere, as the authors' serl_action_mask (recipe/serl/serl_ray_trainer.py:23-29, 69-96)",
    )
    teacher: str | None = setting(None, "teacher model; null: the policy that made the rollouts")
    skip_zero_advantage: bool = setting(
        True,
        "a turn with advantage 0 keeps weight 1 whatever the teacher says: don't score it. false = the "
        "teacher's log-probs are wanted for themselves (distillation: sdpo needs false), so lambda = 0 does "
        "not skip the teacher",
    )
    teacher_sync_interval: int = setting(
        10,
        "online loop: the teacher is the policy snapshot of every N-th update; 1 = the rollout policy",
        limit=at_least(1, whole=True),
    )
    # a weight is 1 +- c: c > 1 could turn an advantage's sign (c = 1 zeroes it)
    weight_clip: float = setting(0.2, "c: weights are clipped to [1 - c, 1 + c]", limit=within(0, 1))
    mixing_lambda: float = setting(0.5, "lambda at update 0", limit=within(0, 1))
    lambda_decay_steps: int = setting(
        50, "updates over which lambda decays to 0; 0 = no decay", limit=at_least(0, "0 (no decay) or more", whole=True)
    )
    update_step: int = setting(0, "the update these annotations feed (lambda schedule)")
    seed: int = setting(0, "random placement")
    threads: int | None = setting(
        None,
        "torch threads; null: all cores. In the online loop: train.threads",
        limit=at_least(1, "at least 1 (or unset: every core)", whole=True),
    )
    device: Device = setting(
        "auto",
        "serl annotate's teacher (models.device): auto (CUDA when present) | cpu | cuda. The online loop's "
        "teacher is the trainer's snapshot: train.device",
    )
    dtype: Dtype = setting(
        "auto",
        "auto (bf16 on a GPU with it, else fp32; autocast) | fp32 | bf16 | fp16. In the online loop: train.dtype",
    )
    micro_batch_tokens: int = setting(
        16384, "padded tokens per teacher forward pass: bounds memory", limit=at_least(1, whole=True)
    )
    teacher_signal: bool = setting(True, "check the teacher against the expert action, where turns have one")
    teacher_signal_every: int = setting(
        10,
        "the online loop checks the teacher (teacher_signal) on iterations 0, every, 2 every, .. and the last: on "
        "Sokoban a check costs about as much as the teacher's own scoring, and it changes no update. 1: every "
        "iteration. serl annotate checks whenever teacher_signal is on",
        limit=at_least(1, "a positive number of iterations", whole=True),
    )


def validate(cfg: AnnotateConfig) -> list[list[str]]:
    """Every setting that can be wrong, before any model loads; returns the parsed sources."""
    spec = fb.parse_sources(cfg.sources)
    cfgmod.check_choices(cfg)
    placement.check_rule(cfg.placement, rho=cfg.rho)
    cfgmod.check_limits(cfg)  # the declared limits (setting(..., limit=...))
    return spec
