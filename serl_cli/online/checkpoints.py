"""Where the online loop's iterations keep their checkpoints, which are due, which one a
resumed run starts from, and which are pruned (the rules: :mod:`serl_cli.online.loop`'s
docstring). Decided from the run directory's files alone, before any model loads; apart from
the loop so they read, and are tested, on their own.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from serl_cli.artifacts import io
from serl_cli.artifacts.records import Manifest
from serl_cli.errors import SerlError
from serl_cli.models.loading import ADAPTER_CONFIG
from serl_cli.online.config import OnlineConfig


def iter_dir(run: Path, k: int) -> Path:
    """Iteration k's directory in the run."""
    return run / f"iter_{k:04d}"


def keep_iterations_before(path: Path, start: int) -> None:
    """Drop a JSONL journal's records of iteration ``start`` and later (a resumed run redoes them)."""
    if path.exists():
        io.write_jsonl(path, [r for r in io.iter_jsonl(path) if r.get("iteration", -1) < start])


def finished_iterations(manifest: Manifest) -> int:
    done = [int(name.split("_")[1]) for name, s in manifest.stages.items() if name.startswith("iter_") and s.done]
    return max(done) + 1 if done else 0


def checkpoint_due(cfg: OnlineConfig, k: int) -> bool:
    """Whether iteration k writes its checkpoint on schedule (every ``save_every``, and the last)."""
    return (k + 1) % max(cfg.save_every, 1) == 0 or k == cfg.iterations - 1


def resumable(run: Path, k: int) -> bool:
    """Whether iteration k's checkpoint is whole: a model and its resume state."""
    last = iter_dir(run, k) / "checkpoint"
    return ((last / "config.json").is_file() or (last / ADAPTER_CONFIG).is_file()) and (
        last / "trainer_state.pt"
    ).is_file()


def resume_point(run: Path, cfg: OnlineConfig, finished: int) -> int:
    """The first iteration a resumed run runs: after the newest finished iteration with a
    checkpoint (the finished ones after it are redone). A checkpoint that was due and is
    missing is an error, not a silent restart from further back."""
    for k in range(finished - 1, -1, -1):
        if resumable(run, k):
            return k + 1
        if checkpoint_due(cfg, k):
            raise SerlError(
                f"cannot resume {run}: iteration {k} is marked done but {iter_dir(run, k) / 'checkpoint'} is missing"
            )
    return 0


def record_checkpoint(run: Path, k: int) -> None:
    """Iteration k's checkpoint files' digests into its manifest entry, for the resume that trusts them."""
    digests = io.digest_files(iter_dir(run, k) / "checkpoint")
    io.mark_stage(run, iter_dir(run, k).name, "done", checkpoint_sha256=digests)


def check_resume_checkpoint(run: Path, manifest: Manifest, start: int) -> None:
    """The checkpoint a resume at ``start`` loads holds the files its iteration wrote, byte for byte
    (a run from before serl kept digests: nothing to check)."""
    if start > 0:
        name = iter_dir(run, start - 1).name
        recorded = manifest.stage(name).get("checkpoint_sha256")
        io.check_digests(iter_dir(run, start - 1) / "checkpoint", recorded, f"iteration {start - 1}")


def prune_checkpoints(run: Path, keep_last: int) -> None:
    """Keep the newest ``keep_last`` iteration checkpoints (0: all); the staging copies a
    crash may leave (``.checkpoint.*``) go with the versions they belong to."""
    if keep_last <= 0:
        return
    found = sorted(run.glob("iter_*/checkpoint"))
    for old in found[:-keep_last]:
        shutil.rmtree(old)


# what an iteration writes that the loop never reads again once the iteration is done
RECORD_FILES = ("rollouts.jsonl", "annotations.jsonl")


def retire_old_rollouts(run: Path, newest: int, mode: str) -> int:
    """Apply ``old_rollouts`` (``OnlineConfig``) to the record files of every iteration before
    ``newest`` (older ones a run with ``keep`` left, too: the setting may change on resume).
    Returns the bytes freed."""
    if mode == "keep":
        return 0
    freed = 0
    for k in range(newest):
        for name in RECORD_FILES:
            path = iter_dir(run, k) / name
            gz = path.with_name(name + ".gz")
            if mode == "gzip" and path.is_file():
                size = path.stat().st_size
                freed += size - io.gzip_file(path).stat().st_size
            elif mode == "delete":
                for found in (p for p in (path, gz) if p.is_file()):
                    freed += found.stat().st_size
                    found.unlink()
    return freed
