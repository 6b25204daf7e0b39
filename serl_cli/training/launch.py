"""Whether serl was started the way ``train.gpus`` says: one process per listed GPU, by a launcher.

Checked by ``serl train`` before anything loads. torchrun sets ``WORLD_SIZE`` and
``LOCAL_WORLD_SIZE``, the deepspeed launcher ``WORLD_SIZE`` and ``LOCAL_SIZE``; a plain process
has neither (or ``WORLD_SIZE=1``, inherited from a parent's group of one).
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from serl_cli.errors import SerlError


def processes(environ: Mapping[str, str]) -> tuple[int, int]:
    """(processes in the job, processes on this node) as the launcher announced them; (1, 1) alone."""
    world = int(environ.get("WORLD_SIZE") or 1)
    local = int(environ.get("LOCAL_WORLD_SIZE") or environ.get("LOCAL_SIZE") or world)
    return world, local


def torchrun_line(argv: Sequence[str], nproc: int) -> str:
    """The command that starts ``argv`` (a ``serl ...`` command line) as ``nproc`` processes."""
    return shlex.join(["torchrun", "--standalone", "--nproc_per_node", str(nproc), "-m", "serl_cli", *argv[1:]])


def check_launch(
    gpus: list[int] | None, environ: Mapping[str, str], argv: Sequence[str], backend: str = "deepspeed"
) -> None:
    """``train.gpus`` against the processes started: a multi-GPU list run as one process is a
    ZeRO group of one on the first GPU (a 7B model's whole optimizer state on it); a node with
    more or fewer processes than GPUs listed trains on the wrong ones."""
    if not gpus:
        return
    world, local = processes(environ)
    if backend == "torch" and len(gpus) > 1:
        raise SerlError(
            f"train.gpus lists {len(gpus)} GPUs but the torch backend trains on one: list one, or train on "
            f"all of them with --backend deepspeed: {torchrun_line(argv, len(gpus))}"
        )
    if world == 1 and len(gpus) > 1:
        raise SerlError(
            f"train.gpus lists {len(gpus)} GPUs ({', '.join(map(str, gpus))}) but serl runs as one process: "
            f"start one per GPU: {torchrun_line(argv, len(gpus))}"
        )
    if world > 1 and local != len(gpus):
        raise SerlError(
            f"train.gpus lists {len(gpus)} GPUs ({', '.join(map(str, gpus))}) but {local} processes were started on "
            f"this node: start them with --nproc_per_node {len(gpus)}, or list {local} GPUs in train.gpus"
        )
