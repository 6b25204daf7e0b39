"""The DeepSpeed backend: ZeRO stage 1, 2 or 3 from a DeepSpeed JSON config.

Launch it the way DeepSpeed jobs are launched -- ``torchrun -m serl_cli train ...``,
``deepspeed --module serl_cli train ...`` or plain ``serl train`` (one process) -- with
``--backend deepspeed``. The configuration is a user's JSON file or serl's default for the
stage (``experiments/deepspeed/zero{1,2,3}.json`` hold the same dictionaries); serl fills in
the keys it owns (``training.deepspeed_config``) and refuses a file that sets them to something else.

How serl's update maps onto the engine:

* serl cuts an optimizer step into micro-batches by padded tokens, so their number varies
  from step to step. The engine runs with ``managed_gradient_accumulation: false``:
  ``backward`` only accumulates and ``step`` is the boundary, whatever the count.
* Data parallel: every process reads the same batch and builds the same micro-batches;
  process r runs micro-batches r, r + W, r + 2W, ... Every process must run as many
  forward/backward passes as the others (ZeRO's collectives happen inside them), so one
  with fewer re-runs its first micro-batch with loss x 0 (gradient exactly 0).
* The loss of every turn is already divided by the whole step's token count, and the
  engine averages gradients over the W processes, so each process's loss is scaled by W:
  the update equals the single-process one.
* A non-finite loss is turned into NaN gradients, which the ZeRO optimizer's overflow
  check (fp32, and bf16 with ``check_grad_overflow``) sees on every process and skips the
  step on all of them, as the torch backend skips it.
* The optimizer is serl's ``torch.optim.AdamW`` (no compiled op), unless the JSON has an
  ``optimizer`` section (DeepSpeed's fused or CPU Adam); its lr, betas and weight decay are
  serl's ``train.optim`` settings either way, as is ``gradient_clipping``.

Checkpoints stay Hugging Face directories -- under ZeRO-3 the partitions are gathered
first -- plus ``deepspeed/``, the engine's own checkpoint (fp32 master weights and
optimizer partitions), which ``--resume`` loads. Every process must see the same
filesystem (DeepSpeed's assumption too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from serl_cli.algos.batch import MicroBatch
from serl_cli.errors import SerlError
from serl_cli.training.deepspeed_config import resolve_config, uses_bf16, uses_fp16, zero_stage
from serl_cli.training.distributed import choose_accelerator, host_group, import_deepspeed, init_distributed
from serl_cli.training.step import ADDITIVE_STATS, LossFn, forward, made_by_wrap, make_optimizer, make_scheduler
from serl_cli.training.train_config import TrainConfig, scheduled

ENGINE_DIR = "deepspeed"  # inside a checkpoint: the engine's own resume files
ENGINE_TAG = "state"


@contextmanager
def _zero3_hooks_off(engine: Any) -> Iterator[Any]:
    """Every parameter gathered whole and every ZeRO-3 hook removed, then put back.

    DeepSpeed's own ``unwrap_model_for_generation`` keeps the root module's start-of-forward
    hook, which checks with the other processes on each forward: a forward that only the
    main process runs (generation, teacher scoring) would wait for them forever.
    """
    from deepspeed.runtime.zero.partition_parameters import GatheredParameters

    offload = engine.optimizer.parameter_offload
    module = engine.module
    with GatheredParameters(list(module.parameters())):
        start_of_forward = module._forward_pre_hooks[offload.fwd_pre_hook.id]
        for hook in offload.forward_hooks + offload.backward_hooks + [offload.fwd_pre_hook]:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield module
        finally:  # back in the order DeepSpeed registers them
            offload.fwd_pre_hook = module.register_forward_pre_hook(start_of_forward)
            offload._register_deepspeed_module(module)


class DeepSpeedBackend:
    """A DeepSpeed engine around the policy; see the module docstring for the mapping."""

    name = "deepspeed"

    def __init__(self, cfg: TrainConfig):
        from serl_cli.models.device import Precision, attention_implementation
        from serl_cli.models.device import resolve as resolve_precision

        self.cfg = cfg
        # validate before starting anything: bad input is one line, not a half-started job
        wanted = resolve_precision(cfg.device, cfg.dtype, cfg.attn_implementation, cfg.gpus)
        self.config = resolve_config(
            cfg.deepspeed, cfg.optim, bf16_available=wanted.dtype == torch.bfloat16, dtype=cfg.dtype
        )
        self.stage = zero_stage(self.config)
        # DeepSpeed holds the module in the half dtype itself (fp32 master weights in its optimizer)
        half = torch.bfloat16 if uses_bf16(self.config) else torch.float16 if uses_fp16(self.config) else None
        self.load_dtype = half or torch.float32
        self.precision = Precision(
            wanted.device,
            half or torch.float32,
            attention_implementation(cfg.attn_implementation, wanted.device, half or torch.float32),
        )
        choose_accelerator(wanted.device)
        self._deepspeed = import_deepspeed()
        if wanted.device.type == "cuda":
            torch.cuda.set_device(wanted.device)  # before NCCL starts: each process on its own GPU
        init_distributed(self._deepspeed, wanted.device, cfg.dist_timeout_s)
        import torch.distributed as dist

        self._dist = dist
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._host = host_group(cfg.dist_timeout_s) if self.world > 1 else None  # waits and object gathers
        self.is_main = self.rank == 0
        # DeepSpeed's engine and optimizer (no annotations of their own), made by wrap()
        self._engine: Any = None
        self._optimizer: Any = None
        self._gathered = 0

    @property
    def device(self) -> torch.device:
        return torch.device(self.engine.device)

    def wrap(self, model: Any) -> None:  # a Hugging Face model, or its peft wrapper
        client_optimizer = None if "optimizer" in self.config else make_optimizer(model, self.cfg.optim)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # the process's GPU: LOCAL_RANK's, or train.gpus[LOCAL_RANK] (split from vLLM's devices)
        args = (
            SimpleNamespace(device_rank=self.precision.device.index) if self.precision.device.type == "cuda" else None
        )
        try:
            self._engine, self._optimizer, _, _ = self._deepspeed.initialize(
                args=args,
                model=model,
                optimizer=client_optimizer,
                model_parameters=trainable,
                config=self.config,
                # the engine steps it after each applied step and keeps it in its checkpoint
                lr_scheduler=partial(make_scheduler, cfg=self.cfg.optim) if scheduled(self.cfg.optim) else None,
            )
        except (ValueError, AssertionError, TypeError, KeyError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SerlError(
                f"DeepSpeed rejected the configuration ({self.cfg.deepspeed.config or 'serl default'}): {first}"
            ) from None

    @property
    def engine(self) -> Any:
        return made_by_wrap(self._engine, "engine")

    @property
    def optimizer(self) -> Any:
        return made_by_wrap(self._optimizer, "optimizer")

    @property
    def module(self) -> Any:
        return self.engine.module

    def step(
        self,
        micro_batches: list[MicroBatch],
        loss_fn: LossFn,
        num_tokens: float,
        temperature: float,
        entropy: bool = False,
    ) -> dict:
        mine = micro_batches[self.rank :: self.world]
        passes = -(-len(micro_batches) // self.world)  # the same on every process
        run_tokens = sum(mb.reply_mask.sum().item() for mb in micro_batches)
        stats: dict[str, float] = {}
        total_loss, finite = 0.0, True
        for j in range(passes):
            real = j < len(mine)
            mb = mine[j] if real else micro_batches[0]  # a stand-in pass: collectives need every process
            logp = forward(self.engine, mb, temperature, entropy)
            loss, s = loss_fn(mb, logp, num_tokens)
            if not real:
                loss, s = loss * 0.0, {}
            if not torch.isfinite(loss):
                finite = False
                loss = logp.sum() * float("nan")  # NaN gradients: the overflow check skips the step everywhere
            self.engine.backward(loss * self.world, scale_wrt_gas=False)
            if real and finite:
                total_loss += loss.item()
                share = mb.reply_mask.sum().item() / max(run_tokens, 1)
                for key, v in s.items():
                    stats[key] = stats.get(key, 0.0) + (v if key in ADDITIVE_STATS else v * share)
        lr = self.engine.get_lr()[0] if self.engine.lr_scheduler is not None else None
        self.engine.step()
        applied = self.engine.was_step_applied()
        if self.world > 1:
            gathered: list[Any] = [None] * self.world
            self._dist.all_gather_object(gathered, (stats, total_loss, finite), group=self._host)
            stats, total_loss = {}, 0.0
            for part, part_loss, part_finite in gathered:
                finite = finite and part_finite
                total_loss += part_loss
                for key, v in part.items():
                    stats[key] = stats.get(key, 0.0) + v
        if not finite:
            return {"skipped": 1.0, "loss": float("nan")}
        grad_norm = self.engine.get_global_grad_norm()
        grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
        if not applied:
            return {"skipped": 1.0, "loss": total_loss, "grad_norm": float("nan")}
        stats.update(loss=total_loss, grad_norm=grad_norm, skipped=0.0)
        if lr is not None:
            stats["lr"] = lr
        return stats

    @contextmanager
    def full_model(self) -> Iterator[Any]:
        """The module with every parameter whole. Under ZeRO-3 that is a collective: every
        process enters (the partitions are gathered on each, the ZeRO hooks are off while
        it lasts); changes made inside are dropped on exit. Re-entrant."""
        if self.stage < 3 or self._gathered:
            yield self.engine.module
            return
        self._gathered += 1
        try:
            with _zero3_hooks_off(self.engine):
                yield self.engine.module
        finally:
            self._gathered -= 1

    @property
    def sharded(self) -> bool:
        """Whether each process keeps only a partition of every weight (ZeRO-3)."""
        return self.stage == 3

    @property
    def collective_forward(self) -> bool:
        """Whether a forward pass needs every process (ZeRO-3 gathers each layer's weights
        inside it): then every process must run as many forward passes as the others."""
        return self.stage == 3 and self.world > 1

    def gathered(self, params: list[torch.nn.Parameter]) -> AbstractContextManager:
        """Context: ``params`` whole on every process while it lasts (a collective under
        ZeRO-3: every process enters with the same list); changes made inside are dropped."""
        if self.stage < 3:
            return nullcontext()
        from deepspeed.runtime.zero.partition_parameters import GatheredParameters

        return GatheredParameters(list(params))

    # param: Any, as under ZeRO-3 it carries DeepSpeed's own attributes (ds_tensor)
    def local_values(self, param: Any) -> torch.Tensor:
        """The tensor holding this process's values of ``param``: under ZeRO-3 its partition
        (``ds_tensor``, what every gather reads from and the optimizer step writes to), else
        the whole weight."""
        return param.ds_tensor.data if self.stage == 3 else param.data

    def local_part(self, param: Any, whole: torch.Tensor) -> torch.Tensor:
        """This process's share of ``whole``, a full value of ``param``, shaped as :meth:`local_values`:
        under ZeRO-3 the slice DeepSpeed partitions to this rank -- the flattened weight cut into
        ``world`` equal parts, the last padded with zeros (``partition_parameters._partition_param``)."""
        if self.stage != 3:
            return whole
        n = param.ds_tensor.numel()
        part = whole.reshape(-1)[self.rank * n : (self.rank + 1) * n]
        if part.numel() < n:
            part = torch.cat([part, part.new_zeros(n - part.numel())])
        return part.reshape(param.ds_tensor.shape)

    def release_gathered(self) -> None:
        """Under ZeRO-3 drop every gathered copy, the persistent small weights' included
        (DeepSpeed's ``empty_partition_cache``), so the next forward gathers from the
        partitions as they are now."""
        if self.stage == 3:
            self.engine.empty_partition_cache()

    def resume_state(self) -> dict:
        return {}  # the optimizer lives in the engine's own checkpoint

    def save_engine_state(self, directory: Path) -> None:
        """The engine's checkpoint (every process writes its partitions)."""
        lora = self.cfg.lora.rank > 0
        self.engine.save_checkpoint(str(directory / ENGINE_DIR), tag=ENGINE_TAG, exclude_frozen_parameters=lora)

    def load_state(self, state: dict, directory: Path) -> None:
        engine_dir = directory / ENGINE_DIR
        if not (engine_dir / ENGINE_TAG).is_dir():
            raise SerlError(
                f"cannot resume with --backend deepspeed: {directory} has no DeepSpeed checkpoint "
                f"({ENGINE_DIR}/{ENGINE_TAG}); it was written by another backend"
            )
        loads_data_only(self.engine)
        try:
            path, _ = self.engine.load_checkpoint(
                str(engine_dir),
                tag=ENGINE_TAG,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
                load_module_strict=self.cfg.lora.rank == 0,
            )
        except (AssertionError, RuntimeError, KeyError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise SerlError(
                f"cannot resume from {engine_dir} with ZeRO stage {self.stage} on {self.world} "
                f"process(es): it was saved with other settings ({first})"
            ) from None
        if path is None:
            raise SerlError(f"DeepSpeed could not load its checkpoint from {engine_dir}")

    def all_gather(self, obj: object) -> list:
        """``obj`` of every process, in rank order."""
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        self._dist.all_gather_object(out, obj, group=self._host)  # on the host (host_group)
        return out

    def barrier(self) -> None:
        if self.world > 1:
            self._dist.barrier(group=self._host)


# The types DeepSpeed pickles into its checkpoint beside tensors and plain values (ZeRO 1-3 on
# deepspeed 0.19.8: the loss scaler, the stage enum, bf16/ZeRO fragment addresses): the only
# objects a resume lets its files build.
DEEPSPEED_STATE_TYPES = (
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"),
)


def loads_data_only(engine: Any) -> None:
    """Make ``engine`` read its checkpoint files as data (``torch.load(weights_only=True)`` with
    :data:`DEEPSPEED_STATE_TYPES` allowed), where DeepSpeed's own engine unpickles whatever they
    hold: a run folder someone else wrote runs no code on a resume."""
    import importlib

    from serl_cli.artifacts import io

    allowed = []
    for module, name in DEEPSPEED_STATE_TYPES:
        try:
            allowed.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):  # another DeepSpeed release: what it lacks it cannot have written
            continue
    checkpoints = engine.checkpoint_engine

    def load(path: str, map_location: str | torch.device | None = None) -> Any:
        with torch.serialization.safe_globals(allowed):
            return io.torch_load(path, "a DeepSpeed checkpoint file", map_location=map_location or "cpu")

    checkpoints.load = load
