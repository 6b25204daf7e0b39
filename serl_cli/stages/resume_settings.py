"""What ``--resume`` may change: a resumed run keeps the settings it was started with.

A run directory holds one run. Resuming it with other settings would leave a record that no
single configuration made (iterations 0-1 as GRPO, iteration 2 as SERL, and a manifest that
says SERL), so a difference is refused in one line naming the first setting that differs.
The settings below are the exception: they change how the run is carried out (how long it
goes on, where its checkpoints are kept, the machine's threads and memory knobs), not what
it computes, so a resume may change them, and the manifest records each change
(``stages.online.resumed``). docs/RELIABILITY.md lists them too; keep the two in step.
"""

from __future__ import annotations

import time

from serl_cli.artifacts import io
from serl_cli.errors import SerlError

# Dotted keys of the online loop's run settings (RUN/online.yaml). ``train.*`` keys apply to a
# single update's resume too (serl_cli.stages.train). Flags that are no setting at all
# (--report-to, -q/-v, --no-plan-check) are never compared.
RESUMABLE_CHANGES = (
    "iterations",  # a run goes on for longer (or stops sooner, not before what it finished)
    "out",  # the run directory itself, however spelt
    "save_every",  # which iterations keep a checkpoint: a resumed run's artifacts are the same
    "keep_last",
    "old_rollouts",  # what becomes of files the loop never reads again
    "env.step_timeout_s",  # a guard against a hung environment
    "train.threads",  # CPU threads, and memory knobs that split the same computation differently
    "train.dist_timeout_s",
    "train.gradient_checkpointing",
    "train.optim.micro_batch_tokens",
    "annotate.micro_batch_tokens",
    "rollout.vllm.gpu_memory_utilization",
    "rollout.vllm.enforce_eager",
    "rollout.vllm.sleep",
    "producer.mode",  # where the stale rollouts are made: the same rollouts either way (max_staleness is not here)
    "producer.threads",
)


def without_changeable(settings: dict, prefix: str = "") -> dict:
    """``settings`` (a plain config, its keys under ``prefix``) without the keys a resume may change."""
    plain = io.json_copy(settings)
    for key in RESUMABLE_CHANGES:
        if not key.startswith(prefix):
            continue
        *parents, last = key[len(prefix) :].split(".")
        node = plain
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(last, None)
    return plain


def changed_settings(stored: dict, now: dict) -> dict:
    """The resumable settings whose value differs: ``{key: [stored, now]}``."""
    changed = {}
    for key in RESUMABLE_CHANGES:
        a, b = _get(stored, key), _get(now, key)
        if a != b:
            changed[key] = [a, b]
    return changed


def _get(settings: dict, key: str):
    node = io.json_copy(settings)
    for part in key.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def check_online_resume(run, stored: dict | None, now: dict, finished: int) -> dict:
    """Refuse to resume the online run in ``run`` with settings other than ``stored`` (its
    manifest's), bar :data:`RESUMABLE_CHANGES`; returns the resumable changes. ``finished``:
    how many iterations the run has finished (``--iterations`` may not go below them)."""
    if stored is None:  # a manifest from before the settings were recorded: nothing to hold it to
        return {}
    stored = with_defaults(stored)
    diff = io.first_difference(without_changeable(stored), without_changeable(now))
    if diff is not None:
        raise SerlError(
            f"cannot resume {run} with other settings ({io.difference_text(*diff)}): a run directory holds "
            f"one run; pass a new --out to start another, or --overwrite to start this one again"
        )
    if now["iterations"] < finished:
        raise SerlError(
            f"cannot resume {run} with --iterations {now['iterations']}: it has finished {finished} "
            f"iterations; pass at least {finished}, or a new --out to start another run"
        )
    return changed_settings(stored, now)


def with_defaults(stored: dict) -> dict:
    """``stored`` with the settings this version of serl has and the run's own serl did not, at
    their defaults (a new setting's default computes what the run computed): a run resumes after
    an upgrade. Settings this version does not know are kept, and so differ."""
    from serl_cli import config as cfgmod
    from serl_cli.stages.online_config import OnlineConfig
    from serl_cli.stages.run_file import run_settings

    try:
        return run_settings(cfgmod.from_dict(OnlineConfig, io.json_copy(stored), "the stored run settings"))
    except SerlError:
        return stored


def record_resume(run, now: dict, start: int, changed: dict) -> None:
    """The manifest's online stage: running again, with the settings it now runs with and,
    in ``resumed``, each resume (where it started, what it changed)."""
    path = run / "manifest.json"
    manifest = io.read_json(path)
    entry = manifest.setdefault("stages", {}).setdefault("online", {})
    entry.pop("finished", None)
    entry.update(status="running", config=now)
    entry.setdefault("resumed", []).append({"at_iteration": start, "time": time.time(), "changed": changed})
    io.write_json(path, manifest)
