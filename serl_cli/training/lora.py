"""LoRA adapters via peft: only the low-rank matrices train; the base weights stay frozen.

Memory is the point, so the two frozen policies the algorithms need come from the one
network instead of extra copies:

* the KL reference (``train.kl_coef > 0``) is the starting policy, i.e. the base model:
  the live model with its adapters disabled (:func:`reference_view`);
* the hindsight teacher is the policy as it was at the last sync: a copy of the adapter
  weights only, swapped in while it scores (``method.teacher.TeacherSnapshot``).

Checkpoints (``train.lora.save``):

* ``merged`` (default): the directory is a plain Hugging Face model with the adapter
  folded into the base weights (``W + B A * alpha / r``), loadable by anything; the
  adapter itself is kept in ``adapter/`` for resuming.
* ``adapter``: the directory holds only the adapter (peft's layout, which names its base
  model) and the tokenizer; ``models.loading.load_adapter_model`` puts them back together.

An engine with its own copy of the weights (vLLM) gets the merged weights streamed, one
layer at a time (:func:`merged_weights`), never a merged copy of the whole model.

peft is an optional extra, imported only when LoRA is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING

import torch

from serl_cli.errors import SerlError
from serl_cli.models.loading import import_peft
from serl_cli.training.train_config import LoraConfig

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel


def enabled(cfg: LoraConfig) -> bool:
    return cfg.rank > 0


def _target_modules(targets: str) -> str | list[str]:
    names = [t.strip() for t in targets.split(",") if t.strip()]
    return "all-linear" if names == ["all-linear"] else names


def add_adapters(model: PreTrainedModel, cfg: LoraConfig, base_name: str) -> PeftModel:
    """``model`` wrapped with fresh trainable adapters (A random from torch's RNG, B = 0,
    so the wrapped model starts exactly equal to ``model``)."""
    peft = import_peft()
    spec = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        target_modules=_target_modules(cfg.targets),
        lora_dropout=cfg.dropout,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        wrapped = peft.get_peft_model(model, spec)
    except ValueError as e:
        raise SerlError(f"train.lora.targets {cfg.targets!r}: {str(e).splitlines()[0]}") from None
    wrapped.peft_config["default"].base_model_name_or_path = base_name
    return wrapped


@contextmanager
def reference_view(model: PeftModel) -> Iterator[PeftModel]:
    """The base model: the starting policy, the adapters switched off for the duration."""
    with model.disable_adapter():
        yield model


def merged_state_dict(model: PeftModel) -> dict[str, torch.Tensor]:
    """The base model's state dict with every adapter folded in (``W + delta``), computed
    into new tensors: the live weights are not touched (merging in place and unmerging
    would not give the same floats back)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    deltas = {}
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            adapter = module.active_adapters[0]
            # peft declares get_delta_weight on each concrete layer (Linear, Embedding, ...), not on LoraLayer
            deltas[f"{name}.base_layer.weight"] = module.get_delta_weight(adapter)  # type: ignore[attr-defined]
    out = {}
    for key, value in base.state_dict().items():
        if ".lora_" in key:
            continue
        value = value.detach()
        if key in deltas:
            value = value + deltas[key].to(value.dtype)
        out[key.replace(".base_layer.", ".")] = value.clone()
    return out


def merged_weights(
    model: PeftModel, gathered: Callable[[list[torch.nn.Parameter]], AbstractContextManager]
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`merged_state_dict`'s weights one at a time, each layer's adapter folded in as its
    turn comes (a new tensor for that layer only), the base model's parameter names.
    ``gathered(params)``: the backend's context that makes ``params`` whole (under ZeRO-3 a
    collective: every process iterates the whole stream)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    layers = {f"{name}.base_layer.weight": m for name, m in base.named_modules() if isinstance(m, LoraLayer)}
    for key, param in base.named_parameters():
        if ".lora_" in key:
            continue
        layer = layers.get(key)
        # every concrete LoRA layer is an nn.Module; peft's LoraLayer mixin itself declares neither method
        with gathered(list(layer.parameters()) if layer is not None else [param]):  # type: ignore[attr-defined]
            value = param.data
            if layer is not None:
                with torch.no_grad():
                    delta = layer.get_delta_weight(layer.active_adapters[0])  # type: ignore[attr-defined]
                    value = value + delta.to(value.dtype)
            yield key.replace(".base_layer.", "."), value
