"""What ``--resume`` may change: a resumed run keeps the settings it was started with.

A run directory holds one run. Resuming it with other settings would leave a record that no
single configuration made (iterations 0-1 as GRPO, iteration 2 as SERL, and a manifest that
says SERL), so a difference is refused in one line naming the first setting that differs.
The settings below are the exception: they change how the run is carried out (how long it
goes on, where its checkpoints are kept, the machine's threads and memory knobs), not what
it computes, so a resume may change them, and the manifest records each change
(``stages.online.resumed``). docs/RELIABILITY.md lists them too; keep the two in step. The online
loop's resume is checked and recorded by :mod:`serl_cli.online.resume`.
"""

from __future__ import annotations

from serl_cli.artifacts import io

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
