"""Training backends: where the optimizer step runs and where the weights live.

* ``torch``: one process, the model as loaded, ``torch.optim.AdamW``.
* ``deepspeed``: ZeRO stage 1, 2 or 3 (optionally offloaded to CPU) over however many
  processes the launcher started (``serl_cli.training.deepspeed``, imported only when chosen).

The learner (``serl_cli.training.learner``) keeps the algorithm -- what the loss is, how a
batch is cut into optimizer steps -- and asks its backend for a forward module, one
optimizer step over a list of micro-batches, the full weights on demand (:meth:`full_model`:
under ZeRO-3 they are partitioned across processes), the values a process keeps of each
parameter (:meth:`local_values`: the whole tensor, or under ZeRO-3 its partition), its resume
state, and the process group's basics (rank, all-gather, barrier).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Protocol

import torch

from serl_cli.algos.batch import MicroBatch
from serl_cli.errors import SerlError
from serl_cli.models.device import Precision, grad_scaler, tag
from serl_cli.models.device import resolve as resolve_precision
from serl_cli.training.step import LossFn, accumulate_step, made_by_wrap, make_optimizer, make_scheduler
from serl_cli.training.train_config import TrainConfig


def is_main_process() -> bool:
    """Rank 0 of a launched job (torchrun and the deepspeed launcher set RANK), or a plain process."""
    return int(os.environ.get("RANK", "0")) == 0


class TorchBackend:
    """Single-process training on ``train.device`` in ``train.dtype`` (``models.device``): the
    weights and AdamW's state in fp32 on the device, the forward passes under autocast for
    bf16/fp16 (fp16 with a gradient scaler). On the CPU in fp32 it is the plain model."""

    name = "torch"
    rank, world, is_main = 0, 1, True
    collective_forward = False  # a forward pass needs no other process
    sharded = False  # every weight whole in this process
    load_dtype = torch.float32  # master weights: the update of a small lr survives only in fp32

    def __init__(self, cfg: TrainConfig):
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SerlError(
                "the torch backend runs in one process: under torchrun or the deepspeed launcher "
                "use --backend deepspeed"
            )
        self.cfg = cfg
        self.precision = resolve_precision(cfg.device, cfg.dtype, cfg.attn_implementation, cfg.gpus)
        self.scaler = grad_scaler(self.precision)
        self.model: Any = None  # the policy, made by wrap(): a Hugging Face model, or its peft wrapper
        self._optimizer: torch.optim.Optimizer | None = None
        self.scheduler: torch.optim.lr_scheduler.LambdaLR | None = None

    @property
    def device(self) -> torch.device:
        return self.precision.device

    def wrap(self, model: Any) -> None:  # a Hugging Face model, or its peft wrapper
        if model.device != self.device:
            model = model.to(self.device)
        self.model = tag(model, self.precision)
        self._optimizer = make_optimizer(model, self.cfg.optim)
        self.scheduler = make_scheduler(self._optimizer, self.cfg.optim)

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return made_by_wrap(self._optimizer, "optimizer")

    @property
    def module(self) -> Any:
        """The network as the user knows it (a Hugging Face model, or its peft wrapper)."""
        return self.model

    def step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        num_tokens: float,
        temperature: float,
        entropy: bool = False,
    ) -> dict:
        lr = self.optimizer.param_groups[0]["lr"]
        stats = accumulate_step(
            self.model,
            self.optimizer,
            micro_batches,
            loss_fn,
            num_tokens,
            temperature,
            self.cfg.optim.grad_clip,
            entropy=entropy,
            scaler=self.scaler,
        )
        if self.scheduler is not None and not stats.get("skipped"):
            stats["lr"] = lr  # the step's own lr; a skipped step applied nothing and does not advance it
            self.scheduler.step()
        return stats

    @contextmanager
    def full_model(self) -> Iterator[Any]:
        yield self.model

    def gathered(self, params: list[torch.nn.Parameter]) -> AbstractContextManager:
        """Context: ``params`` whole while it lasts (they always are here)."""
        return nullcontext()

    def local_values(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The tensor holding this process's values of ``param``: here the whole weight."""
        return param.data

    def local_part(self, param: torch.nn.Parameter, whole: torch.Tensor) -> torch.Tensor:
        """This process's share of ``whole``, a full value of ``param``, shaped as :meth:`local_values`."""
        return whole

    def release_gathered(self) -> None:
        """Drop every gathered copy of a partitioned weight (none here)."""

    def resume_state(self) -> dict:
        state = {"optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["grad_scaler"] = self.scaler.state_dict()
        if self.scheduler is not None:
            state["lr_scheduler"] = self.scheduler.state_dict()
        return state

    def save_engine_state(self, directory: Path) -> None:
        """Backend-native resume files (none: the optimizer state goes in trainer_state.pt)."""

    def load_state(self, state: dict, directory: Path) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and "grad_scaler" in state:
            self.scaler.load_state_dict(state["grad_scaler"])
        load_scheduler(self.scheduler, state)

    def all_gather(self, obj: object) -> list:
        """``obj`` of every process, in rank order."""
        return [obj]

    def barrier(self) -> None:
        pass


def load_scheduler(scheduler: torch.optim.lr_scheduler.LambdaLR | None, state: dict) -> None:
    """Put the schedule's step count back. A checkpoint without one was trained at a constant
    lr: a schedule added on resume starts at its step 0 (its warmup), which the optimizer's
    own restored lr is set to."""
    if scheduler is None:
        return
    if "lr_scheduler" in state:
        scheduler.load_state_dict(state["lr_scheduler"])
        return
    for group, base, factor in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(0)


class Backend(Protocol):
    """What the learner asks of a training backend: the model wrapped for training, one optimizer
    step over micro-batches, the weights whole when something outside training reads them, the
    resume state, and the processes' collectives (one process: trivial). What a backend is -- data
    parallel, ZeRO, its own checkpoint -- is ``train_config.BACKEND_TRAITS``, for code that must not
    load it; nothing compares a backend's name."""

    name: str
    rank: int
    world: int
    is_main: bool
    load_dtype: torch.dtype  # what the model loads in
    precision: Precision

    @property
    def sharded(self) -> bool:
        """Weights partitioned over the processes (ZeRO-3): run the model inside ``full_model()``."""
        ...

    @property
    def collective_forward(self) -> bool:
        """A forward pass is a collective: every process runs as many."""
        ...

    @property
    def device(self) -> torch.device: ...

    @property
    def module(self) -> Any: ...

    @property
    def optimizer(self) -> Any: ...

    def wrap(self, model: Any) -> None: ...

    def step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        num_tokens: float,
        temperature: float,
        entropy: bool = False,
    ) -> dict: ...

    def full_model(self) -> AbstractContextManager: ...

    def gathered(self, params: list[torch.nn.Parameter]) -> AbstractContextManager: ...

    def local_values(self, param: torch.nn.Parameter) -> torch.Tensor: ...

    def local_part(self, param: torch.nn.Parameter, whole: torch.Tensor) -> torch.Tensor: ...

    def release_gathered(self) -> None: ...

    def resume_state(self) -> dict: ...

    def save_engine_state(self, directory: Path) -> None: ...

    def load_state(self, state: dict, directory: Path) -> None: ...

    def all_gather(self, obj: object) -> list: ...

    def barrier(self) -> None: ...


def _torch_backend(cfg: TrainConfig) -> Backend:
    return TorchBackend(cfg)


def _deepspeed_backend(cfg: TrainConfig) -> Backend:
    from serl_cli.training.deepspeed import DeepSpeedBackend

    return DeepSpeedBackend(cfg)


BACKENDS: dict[str, Callable[[TrainConfig], Backend]] = {"torch": _torch_backend, "deepspeed": _deepspeed_backend}


def make_backend(cfg: TrainConfig) -> Backend:
    """The training backend ``cfg.backend`` names (DeepSpeed imported only when chosen)."""
    if cfg.backend not in BACKENDS:
        raise SerlError(f"unknown backend {cfg.backend!r}: choose one of {', '.join(BACKENDS)}")
    return BACKENDS[cfg.backend](cfg)
