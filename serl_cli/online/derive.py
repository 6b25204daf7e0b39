"""Run config -> each stage's config, in one place (as prime-rl's ``propagate_shared_fields``).

The online loop's configuration (:class:`~serl_cli.online.config.OnlineConfig`, a run
file) holds each setting once; every stage it runs gets its own config from here: the loop's
iterations, ``serl rollout|eval|annotate --config RUN_FILE`` (``online.run_file``), the single
update ``serl train RUN --config RUN_FILE``, and the ablation grid's final evaluation. So a
stage run by hand on a run file runs as the loop runs it.

The shared settings: the rollouts take the run's environment, starting model and seed (seed *
1000 + k at iteration k); the update the run's seed; the annotation the run's seed and the
update counter; and every stage the trainer's device, precision and threads (in the loop the
hf engine, the teacher and the evaluation run the trainer's own model). The algorithm's needs
(``algos.registry.apply_algorithm``) come on top of the train and annotate sections.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

from serl_cli.algos.registry import apply_algorithm, objective
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig, validate
from serl_cli.online.config import OnlineConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.evaluate import EvalConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.train_config import TrainConfig

# The settings of each section that the run sets itself (below). The resolved online.yaml leaves
# them out, so each setting appears once; a file that sets them (an older online.yaml) still
# loads, and they are ignored.
LOOP_SETS = {
    "rollout": ("env", "model", "seed", "out", "device", "dtype", "threads"),
    "train": ("model", "seed", "checkpoint"),
    "annotate": ("seed", "update_step", "device", "dtype", "threads"),
}
# The run config's top-level keys each stage's config is derived from (the others: a note).
READS = {
    "rollout": ("env", "model", "seed", "rollout", "train"),
    "annotate": ("seed", "annotate", "train"),
    "eval": ("env", "model", "seed", "eval", "rollout", "train"),
    "train": ("seed", "train"),
}


def iteration_seed(run: OnlineConfig, iteration: int | None) -> int:
    """Iteration k's rollouts and annotation: ``seed * 1000 + k``; a stage run by hand: the seed."""
    return run.seed if iteration is None else run.seed * 1000 + iteration


def train_config(run: OnlineConfig) -> TrainConfig:
    """The update's settings: the train section, seeded by the run's seed, with its algorithm's defaults."""
    train, _ = apply_algorithm(dataclasses.replace(copy.deepcopy(run.train), seed=run.seed))
    return train


def rollout_config(run: OnlineConfig, iteration: int | None = None, out: str | Path | None = None) -> RolloutConfig:
    """Iteration ``iteration``'s rollouts, written to ``out`` (None: ``serl rollout``'s default):
    the rollout section on the run's environment, model and seed, on the trainer's device."""
    cfg = copy.deepcopy(run.rollout)
    cfg.env, cfg.model, cfg.seed = copy.deepcopy(run.env), run.model, iteration_seed(run, iteration)
    cfg.device, cfg.dtype, cfg.threads = run.train.device, run.train.dtype, run.train.threads
    cfg.out = str(out) if out is not None else RolloutConfig().out
    return cfg


def annotate_config(run: OnlineConfig, iteration: int | None = None, updates: int = 0) -> AnnotateConfig:
    """The annotation of iteration ``iteration``'s rollouts for update number ``updates``: the
    annotate section with what the run's algorithm needs of it (rlsd: every turn and reply token;
    distillation: the teacher on zero-advantage turns too)."""
    cfg = copy.deepcopy(run.annotate)
    cfg.seed, cfg.update_step = iteration_seed(run, iteration), updates
    cfg.device, cfg.dtype, cfg.threads = run.train.device, run.train.dtype, run.train.threads
    if iteration is not None and not signal_due(run, iteration):
        cfg.teacher_signal = False  # a diagnostic: no update reads it
    _, cfg = apply_algorithm(train_config(run), cfg)
    return cfg


def signal_due(run: OnlineConfig, iteration: int) -> bool:
    """Whether iteration ``iteration`` checks the teacher (``annotate.teacher_signal_every``)."""
    return iteration % max(run.annotate.teacher_signal_every, 1) == 0 or iteration == run.iterations - 1


def prepare_annotation(cfg: AnnotateConfig, train: TrainConfig) -> tuple[TrainConfig, AnnotateConfig]:
    """An annotation by hand (``serl annotate RUN``) for an update under ``train``: refused in one
    line where ``train.algo`` learns from none, else ``(train, cfg)`` with the algorithm's needs
    applied over ``cfg``'s own settings, as the loop applies them, and checked before the teacher
    loads. Copies; the inputs are left as they are."""
    if not objective(train.algo).needs_annotations:
        raise SerlError(f"--algo {train.algo} learns from no annotations: annotate for serl, rlsd or sdpo (--algo)")
    train, cfg = apply_algorithm(train, cfg)
    validate(cfg)
    return train, cfg


def eval_config(run: OnlineConfig, out: str | Path, model: str | None = None) -> EvalConfig:
    """The periodic evaluation of ``model`` (None: a policy the caller passes in, such as the
    loop's in-memory one): ``eval.episodes`` tasks (0: all) of the evaluation split's panel
    (``eval.split``, else the environment's), sampled at ``eval.temperature`` with the run's seed,
    on the rollouts' engine, batch, token budget, coupling and prompt, on the trainer's device."""
    env = EnvConfig(
        run.env.name, run.eval.split, run.env.max_turns, copy.deepcopy(run.env.settings), run.env.step_timeout_s
    )
    rollout = run.rollout
    return EvalConfig(
        env=env,
        policy="model",
        model=model,
        episodes=run.eval.episodes or None,
        seed=run.seed,
        batch_size=rollout.batch_size,
        env_workers=rollout.env_workers,
        dispatch=rollout.dispatch,
        temperature=run.eval.temperature,
        coupled=rollout.sampling.coupled,
        prompt=copy.deepcopy(rollout.prompt),
        history_turns=rollout.prompt.history_turns,
        max_new_tokens=rollout.sampling.max_new_tokens,
        threads=run.train.threads,
        engine=rollout.engine,
        vllm=copy.deepcopy(rollout.vllm),
        gpus=rollout.gpus,
        device=run.train.device,
        dtype=run.train.dtype,
        out=str(out),
    )
