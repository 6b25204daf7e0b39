"""Checkpoints: Hugging Face model directories written atomically, and frozen copies of a policy.

A checkpoint is written into a staging sibling and renamed into place only when complete
(:func:`commit_dir`), so a crash leaves one whole version. A frozen copy (the KL reference,
the teacher snapshot) is a plain model rebuilt from the policy's config and weights.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from serl_cli.artifacts.io import follow_umask, torch_load, torch_save
from serl_cli.errors import SerlError
from serl_cli.models.device import precision_of, tag

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from serl_cli.training.train_config import LoraConfig


# the replica (a PreTrainedModel) typed as a torch Module: transformers wraps PreTrainedModel.to with
# functools.wraps, which mypy then sees unbound (a device passed to it is refused)
def frozen_copy(model: PreTrainedModel, device: torch.device | str | None = None) -> torch.nn.Module:
    """A frozen replica of a (plain Hugging Face) model, built from its config and weights:
    no DeepSpeed or peft state comes along."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):  # building a model draws initial weights: keep the caller's stream
        replica = AutoModelForCausalLM.from_config(model.config, dtype=model.dtype)
    replica.load_state_dict(model.state_dict())
    replica = replica.to(device or model.device).eval().requires_grad_(False)
    precision = precision_of(model)
    return tag(replica, precision) if precision is not None else replica


def save_checkpoint(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    path: str | Path,
    extra_state: dict | None = None,
    extra_files: dict[str, str] | None = None,
) -> Path:
    """A Hugging Face model directory (safetensors), written to a temp sibling then renamed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        write_model_files(model, tokenizer, tmp, extra_state=extra_state, extra_files=extra_files)
        commit_dir(tmp, path)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return path


def write_model_files(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    *,
    state_dict: dict | None = None,
    extra_state: dict | None = None,
    extra_files: dict[str, str] | None = None,
) -> None:
    """``model`` (or ``state_dict`` in ``model``'s architecture) and ``tokenizer`` into ``directory``."""
    model.save_pretrained(directory, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    if extra_state is not None:
        torch_save(extra_state, directory / "trainer_state.pt")
    for name, text in (extra_files or {}).items():
        (directory / name).write_text(text, encoding="utf-8")


def read_trainer_state(path: Path) -> dict:
    """``trainer_state.pt`` (the update counter, the optimizer's moments, the schedule's step, the
    KL reference), as data only (:func:`~serl_cli.artifacts.io.torch_load`)."""
    state = torch_load(path, "the trainer state")
    if not isinstance(state, dict) or not isinstance(state.get("updates"), int):
        raise SerlError(f"{path} is not a serl trainer state (it has no update counter)")
    return state


def commit_dir(tmp: Path, path: Path) -> None:
    """Put the finished ``tmp`` in place of ``path``: the old version is moved aside first
    and removed last, so a crash leaves one whole version."""
    follow_umask(tmp)
    old = None
    if path.exists():
        old = path.with_name(f".{path.name}.old")
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    tmp.rename(path)
    if old is not None:
        shutil.rmtree(old)


def write_policy(
    module: Any,  # the policy: a Hugging Face model, or under LoRA its peft wrapper
    tokenizer: PreTrainedTokenizerBase,
    directory: Path,
    lora: LoraConfig | None = None,
    state: dict | None = None,
    files: dict[str, str] | None = None,
) -> None:
    """A policy's checkpoint files: the model (``lora``: its ``LoraConfig``, saved merged --
    the adapter kept in ``adapter/`` -- or adapter-only), the tokenizer, ``state`` as
    ``trainer_state.pt`` (None: none) and ``files`` (name -> text)."""
    files = files or {}
    if lora is None:
        write_model_files(module, tokenizer, directory, extra_state=state, extra_files=files)
    elif lora.save == "merged":
        from serl_cli.models.loading import ADAPTER_SUBDIR
        from serl_cli.training.lora import merged_state_dict

        write_model_files(
            module.get_base_model(),
            tokenizer,
            directory,
            state_dict=merged_state_dict(module),
            extra_state=state,
            extra_files=files,
        )
        module.save_pretrained(directory / ADAPTER_SUBDIR)
    else:  # adapter only: peft's layout, plus the tokenizer and serl's files
        module.save_pretrained(directory)
        tokenizer.save_pretrained(directory)
        if state is not None:
            torch_save(state, directory / "trainer_state.pt")
        for name, text in files.items():
            (directory / name).write_text(text, encoding="utf-8")
