"""The DeepSpeed backend's configuration: ``train.deepspeed`` and the JSON handed to ``deepspeed.initialize``.

Resolving and checking it needs neither DeepSpeed nor torch, so it lives apart from the
engine wrapper (:mod:`serl_cli.training.deepspeed`): ``check_train_config`` reads it before
any model loads, and the tests check it on any machine. The keys serl owns are set in
:func:`resolve_config` (the backend's module docstring says why).
"""

from __future__ import annotations

import copy
import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serl_cli.config import setting
from serl_cli.errors import SerlError

ZERO_STAGES = (1, 2, 3)
DEFAULT_STAGE = 2
MISSING = "--backend deepspeed needs DeepSpeed: DS_BUILD_OPS=0 pip install 'serl[deepspeed]'"


@dataclass
class DeepSpeedConfig:
    config: str | None = setting(None, "a DeepSpeed JSON file; null: serl's for the stage")
    zero_stage: int | None = setting(
        None, "ZeRO stage 1, 2 or 3: overrides the file's zero_optimization.stage; 2 when neither sets it"
    )
    offload: bool = setting(False, "optimizer states (and, at stage 3, parameters) in CPU memory")


# ZeRO-3 accumulates gradients and reduce-scatters them in the model's dtype unless told otherwise
# (DeepSpeed's engine.get_data_types, communication_data_type): in bf16, a sum over micro-batches and
# processes loses the low bits of every gradient. verl reduces in fp32; so does serl.
FP32_GRADIENTS: dict[str, Any] = {"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"}


def default_config(stage: int) -> dict:
    """serl's DeepSpeed config for a ZeRO stage; experiments/deepspeed/zero{stage}.json is it, written out."""
    zero: dict = {"stage": stage}
    if stage >= 2:
        zero.update(contiguous_gradients=True, overlap_comm=stage == 3, reduce_bucket_size=int(5e8))
    config: dict = {"zero_optimization": zero}
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(5e7), stage3_param_persistence_threshold=int(1e5))
        config.update(FP32_GRADIENTS)
    # "auto": bf16 where the accelerator has it (CUDA), fp32 elsewhere
    config["bf16"] = {"enabled": "auto"}
    return config


def load_config_file(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise SerlError(f"DeepSpeed config file not found: {p}")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise SerlError(f"malformed DeepSpeed JSON in {p} at line {e.lineno}, column {e.colno}: {e.msg}") from None
    except UnicodeDecodeError:
        raise SerlError(f"DeepSpeed config file {p} is not UTF-8 text") from None
    if not isinstance(data, dict):
        raise SerlError(f"DeepSpeed config {p} must hold a JSON object, not a {type(data).__name__}")
    return data


def _own(config: dict, key: str, value: object, why: str, where: str) -> None:
    """Set a key serl decides; a file that sets it to something else is refused ("auto" is fine)."""
    given = config.get(key, "auto")
    if given != "auto" and given != value:
        raise SerlError(
            f"DeepSpeed config {where}: {key} is {given!r} but serl sets it to {value!r} ({why}); "
            f'remove it or write "auto"'
        )
    config[key] = value


# optim: train_config's OptimConfig (and check_config's cfg its TrainConfig), typed Any: train_config imports
# this module, and an import back, even for type checking only, is a cycle (tests/test_import_layers.py)
def resolve_config(ds: DeepSpeedConfig, optim: Any, *, bf16_available: bool, dtype: str = "auto") -> dict:
    """The dictionary handed to ``deepspeed.initialize``: the file (or the stage's default),
    the stage and offload settings, the keys serl owns, and ``train.dtype`` (fp32 | bf16 |
    fp16 sets the file's ``bf16``/``fp16`` sections; ``auto`` leaves them as they are, where
    ``"auto"`` means bf16 when ``bf16_available``)."""
    where = ds.config or "(serl default)"
    config = _starting_config(ds)
    _set_zero(config, ds, where)
    _set_serls_keys(config, optim, where)
    _set_optimizer(config, optim, where)
    _set_precision(config, dtype, bf16_available, where)
    return config


def _starting_config(ds: DeepSpeedConfig) -> dict:
    """A copy of the file, or of serl's config for the stage asked for (checked before it picks one)."""
    if ds.zero_stage is not None and ds.zero_stage not in ZERO_STAGES:
        raise SerlError(f"ZeRO stage must be 1, 2 or 3, got {ds.zero_stage}")
    if ds.config:
        config = load_config_file(ds.config)
    else:
        config = default_config(ds.zero_stage or DEFAULT_STAGE)
    return copy.deepcopy(config)


def _set_zero(config: dict, ds: DeepSpeedConfig, where: str) -> None:
    """The ZeRO stage (``train.deepspeed.zero_stage`` over the file's), stage 3's gradient dtypes and offload."""
    zero = config.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SerlError(f"DeepSpeed config {where}: zero_optimization must be an object")
    if ds.zero_stage is not None:
        zero["stage"] = ds.zero_stage
    zero.setdefault("stage", DEFAULT_STAGE)
    stage = zero["stage"]
    if stage not in ZERO_STAGES:
        raise SerlError(f"ZeRO stage must be 1, 2 or 3, got {stage!r} (zero_optimization.stage in {where})")
    if stage == 3:  # a file's own choice stands; where it makes none, fp32 (FP32_GRADIENTS)
        data_types = config.setdefault("data_types", {})
        if not isinstance(data_types, dict):
            raise SerlError(f"DeepSpeed config {where}: data_types must be an object")
        data_types.setdefault("grad_accum_dtype", FP32_GRADIENTS["data_types"]["grad_accum_dtype"])
        config.setdefault("communication_data_type", FP32_GRADIENTS["communication_data_type"])
    if ds.offload:
        zero.setdefault("offload_optimizer", {"device": "cpu"})
        if stage == 3:
            zero.setdefault("offload_param", {"device": "cpu"})


def _set_serls_keys(config: dict, optim: Any, where: str) -> None:
    """The batch and step keys serl decides, and the defaults that let serl's own optimizer and
    metrics run under DeepSpeed."""
    # serl micro-batches by tokens and owns the boundary of each optimizer step
    _own(config, "train_micro_batch_size_per_gpu", 1, "serl micro-batches by tokens", where)
    _own(config, "gradient_accumulation_steps", 1, "serl micro-batches by tokens", where)
    _own(config, "managed_gradient_accumulation", False, "serl owns the optimizer-step boundary", where)
    _own(config, "gradient_clipping", float(optim.grad_clip), "train.optim.grad_clip", where)
    if config.pop("train_batch_size", "auto") != "auto":
        raise SerlError(
            f"DeepSpeed config {where}: train_batch_size is serl's to decide (turns per step vary); remove it"
        )
    config.setdefault("zero_allow_untested_optimizer", True)  # serl's torch AdamW under ZeRO
    config.setdefault("zero_force_ds_cpu_optimizer", False)  # ... also with CPU offload
    config.setdefault("steps_per_print", 2**31 - 1)  # serl reports its own metrics


def _set_optimizer(config: dict, optim: Any, where: str) -> None:
    """A file's optimizer and scheduler sections, held to ``train.optim``: one source for each setting."""
    if "scheduler" in config and (optim.schedule != "constant" or optim.warmup_steps > 0):
        raise SerlError(
            f"DeepSpeed config {where} has a scheduler section and train.optim.schedule/warmup_steps set one too: "
            "keep one of them"
        )
    optimizer = config.get("optimizer")
    if optimizer is not None:
        if not isinstance(optimizer, dict) or not isinstance(optimizer.get("params", {}), dict):
            raise SerlError(f"DeepSpeed config {where}: optimizer must be an object with a params object")
        params = optimizer.setdefault("params", {})
        _own(params, "lr", float(optim.lr), "train.optim.lr", where)
        _own(params, "betas", list(optim.betas), "train.optim.betas", where)
        _own(params, "weight_decay", float(optim.weight_decay), "train.optim.weight_decay", where)


def _set_precision(config: dict, dtype: str, bf16_available: bool, where: str) -> None:
    """The ``bf16`` and ``fp16`` sections: ``train.dtype`` where it is not auto, then each "auto" decided."""
    for half in ("bf16", "fp16"):
        section = config.get(half)
        if section is not None and not isinstance(section, dict):
            raise SerlError(f"DeepSpeed config {where}: {half} must be an object")
    if dtype != "auto":
        for half in ("bf16", "fp16"):
            on = dtype == half
            section = config.setdefault(half, {})
            given = section.get("enabled", "auto")
            if given != "auto" and bool(given) != on:
                raise SerlError(
                    f"DeepSpeed config {where}: {half}.enabled is {given!r} but train.dtype is {dtype}; "
                    f'write "auto" there or change --dtype'
                )
            section["enabled"] = on
    bf16 = config.setdefault("bf16", {"enabled": False})
    if bf16.get("enabled") == "auto":
        bf16["enabled"] = bf16_available
    if bf16.get("enabled"):
        bf16.setdefault("check_grad_overflow", True)  # a non-finite step is skipped, as in fp32
    if config.get("fp16", {}).get("enabled") == "auto":
        config["fp16"]["enabled"] = False


def zero_stage(config: dict) -> int:
    return int(config["zero_optimization"]["stage"])


def uses_bf16(config: dict) -> bool:
    return bool(config.get("bf16", {}).get("enabled"))


def uses_fp16(config: dict) -> bool:
    return bool(config.get("fp16", {}).get("enabled"))


def check_config(cfg: Any) -> None:  # train_config's TrainConfig (Any: see resolve_config)
    """The configuration resolves and DeepSpeed is installed (nothing is started)."""
    resolve_config(cfg.deepspeed, cfg.optim, bf16_available=False, dtype=cfg.dtype)
    if importlib.util.find_spec("deepspeed") is None:
        raise SerlError(MISSING)
