"""Where a model runs and in which precision: ``--device auto|cpu|cuda``, ``--dtype auto|fp32|bf16|fp16``.

One rule everywhere (training, the hf engine, the teacher, evaluation):

* **device** ``auto`` is CUDA when torch sees a GPU, else the CPU; ``cuda`` without a GPU is
  one line and exit 2. Under torchrun / the deepspeed launcher each process takes the GPU
  of its ``LOCAL_RANK`` (or ``gpus[LOCAL_RANK]`` when a list of GPUs is given).
* **dtype** is the *compute* precision. ``auto`` is bf16 on a GPU that has it, fp32
  elsewhere. Half precision runs through ``torch.autocast`` -- on CUDA and on the CPU alike
  -- so the master weights a trainer updates stay fp32 (an lr of 1e-6 is below bf16's
  resolution for most weights) and only the matmuls run in half precision. fp16 adds a
  gradient scaler (:func:`grad_scaler`). Models that are only run (evaluation, a teacher
  loaded on its own) keep fp32 weights on the CPU and hold them in the half dtype on a GPU
  (half the memory; autocast leaves them as they are).
* **attention**: SDPA, or flash-attention 2 where it is installed, on CUDA, in bf16/fp16.

fp32 on the CPU -- the default on a machine without a GPU -- enters no autocast context
and moves nothing: it runs exactly the code it ran before this module existed.

A model carries its precision as an attribute (:data:`PRECISION_ATTR`, set by
:func:`tag`), so every forward pass that serl makes -- the trainer's, the hf engine's, the
teacher's -- reads it with :func:`autocast` without being told; frozen copies
(``training.checkpoint.frozen_copy``) carry it over.
"""

from __future__ import annotations

import importlib.util
import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch

from serl_cli.errors import SerlError
from serl_cli.models.choices import check_names

# models.choices' dtype words -> torch dtypes
DTYPES = {"auto": None, "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items() if v is not None}
PRECISION_ATTR = "serl_precision"


@dataclass(frozen=True)
class Precision:
    device: torch.device
    dtype: torch.dtype  # the compute dtype; float32 = no autocast
    attn_implementation: str = "sdpa"

    @property
    def half(self) -> bool:
        return self.dtype != torch.float32

    @property
    def name(self) -> str:
        return f"{self.device} {DTYPE_NAMES[self.dtype]}"

    def autocast(self):
        """The autocast context of this precision (nothing at all for fp32)."""
        if not self.half:
            return nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.dtype)

    def storage_dtype(self, training: bool) -> torch.dtype:
        """The dtype a model's weights are held in: fp32 master weights for training and on
        the CPU; the compute dtype for a model only run on a GPU."""
        if training or self.device.type == "cpu":
            return torch.float32
        return self.dtype


def cuda_available() -> bool:
    return torch.cuda.is_available()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(name: str = "auto", gpus: list[int] | None = None) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` -> a torch device; a CUDA device is this process's GPU:
    ``gpus[LOCAL_RANK]`` when a list is given, else ``LOCAL_RANK``."""
    check_names(name, "auto")
    if name == "cpu" or (name == "auto" and not cuda_available()):
        return torch.device("cpu")
    if not cuda_available():
        raise SerlError(
            "--device cuda: torch sees no CUDA device here (torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda or 'none'}); use --device cpu or auto"
        )
    rank = local_rank()
    if gpus:
        if rank >= len(gpus):
            raise SerlError(
                f"process {rank} has no GPU: train.gpus lists {len(gpus)} ({gpus}); start as many "
                f"processes per node as it lists"
            )
        index = int(gpus[rank])
    else:
        index = rank
    count = torch.cuda.device_count()
    if index >= count:
        raise SerlError(f"GPU {index} does not exist: this process sees {count} CUDA device(s)")
    return torch.device("cuda", index)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    check_names("auto", name)
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    dtype = DTYPES[name]
    assert dtype is not None  # only "auto" maps to None, resolved above
    return dtype


def attention_implementation(name: str, device: torch.device, dtype: torch.dtype) -> str:
    """``auto``: flash-attention 2 where it is installed, on CUDA, in half precision; else SDPA."""
    check_names("auto", "auto", name)
    if name != "auto":
        return name
    if device.type == "cuda" and dtype != torch.float32 and importlib.util.find_spec("flash_attn") is not None:
        return "flash_attention_2"
    return "sdpa"


def resolve(device: str = "auto", dtype: str = "auto", attn: str = "auto", gpus: list[int] | None = None) -> Precision:
    check_names(device, dtype, attn)
    dev = resolve_device(device, gpus)
    dt = resolve_dtype(dtype, dev)
    return Precision(dev, dt, attention_implementation(attn, dev, dt))


def tag(model, precision: Precision):
    """Mark ``model`` with its precision (read back by :func:`autocast`); returns it."""
    setattr(model, PRECISION_ATTR, precision)
    return model


def precision_of(model) -> Precision | None:
    return getattr(model, PRECISION_ATTR, None)


def autocast(model):
    """The autocast context ``model``'s forward passes run in (none when untagged or fp32)."""
    p = precision_of(model)
    return nullcontext() if p is None else p.autocast()


def model_device(model) -> torch.device:
    """Where ``model``'s weights live (the CPU for a model without a ``device``)."""
    return getattr(model, "device", None) or torch.device("cpu")


def grad_scaler(precision: Precision):
    """fp16 needs loss scaling (bf16 and fp32 do not): a ``torch.amp.GradScaler``, else None."""
    if precision.dtype != torch.float16:
        return None
    return torch.amp.GradScaler(precision.device.type)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): for honest wall times."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return None


def release_memory() -> None:
    """Return what a finished stage held on the GPU to the driver (another engine starts next)."""
    import gc

    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
