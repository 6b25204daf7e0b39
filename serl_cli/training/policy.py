"""The policy a learner trains, loaded: the model and tokenizer, with LoRA adapters where the run
trains adapters (a fresh run's new ones, or a resumed run's saved ones on the same base)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from serl_cli.models.loading import adapter_dir, base_model_name, load_adapters
from serl_cli.training import lora as lora_mod
from serl_cli.training.train_config import TrainConfig

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_policy(
    model_name: str,
    cfg: TrainConfig,
    dtype: torch.dtype,
    resume_dir: Path | None = None,
    attn_implementation: str | None = None,
) -> tuple[Any, PreTrainedTokenizerBase]:  # the model: a Hugging Face model, or its peft wrapper
    """(model, tokenizer) to train. With LoRA, a fresh run adds new adapters to the model (a
    checkpoint's own adapter, if it has one, is merged into it first), so the model as
    loaded is the starting policy and the KL reference is that model with adapters off; a
    resumed run puts its saved adapter back on the same base and keeps training it."""
    from functools import partial

    from serl_cli.models.loading import load_model

    load_model = partial(load_model, attn_implementation=attn_implementation)
    if not lora_mod.enabled(cfg.lora):
        return load_model(model_name, dtype)
    adapter = adapter_dir(resume_dir) if resume_dir is not None else None
    if adapter is not None:
        from transformers import AutoTokenizer

        base, _ = load_model(base_model_name(adapter), dtype)
        return load_adapters(base, adapter, trainable=True), AutoTokenizer.from_pretrained(str(resume_dir))
    model, tokenizer = load_model(model_name, dtype)
    path = Path(model_name).expanduser()
    base_name = str(path.resolve()) if path.exists() else model_name  # resumable from any working directory
    return lora_mod.add_adapters(model, cfg.lora, base_name), tokenizer
