"""Loading a policy: a local Hugging Face model directory, a hub name, or a LoRA adapter-only
checkpoint (its base model plus the adapter), through one :func:`load_model`.

peft is an optional extra, imported only when an adapter is loaded.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import torch
from huggingface_hub import is_offline_mode
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, AutoTokenizer

from serl_cli.errors import SerlError


def quiet_transformers() -> None:
    """transformers draws a progress bar for every model it loads ("Loading weights") and saves
    ("Writing model shards"): a demo makes about ninety, and on a terminal they break up serl's
    own lines and live table (in a log file they never showed: serl's CLI turns all library bars
    off when stderr is not a terminal). Off wherever serl loads or saves a model, spawned
    processes included; the hub's own download bars stay as they were, so a real download still
    shows its progress. Also silenced: DeepSpeed's "Setting accelerator to CPU" warning, which
    saving a model prints on any CPU machine with deepspeed installed (accelerate imports it)."""
    import logging

    from huggingface_hub.utils import are_progress_bars_disabled, enable_progress_bars
    from transformers.utils import logging as transformers_logging

    hub_bars = not are_progress_bars_disabled()
    transformers_logging.disable_progress_bar()  # transformers' own bars; this turns the hub's off too
    if hub_bars:
        enable_progress_bars()
    logging.getLogger("DeepSpeed").addFilter(lambda record: "Setting accelerator to CPU" not in record.getMessage())


quiet_transformers()  # at import: every serl module that loads or saves a model imports this one


class ModelError(SerlError, ValueError):
    """A model name or directory that cannot be used; the message is one line for the CLI."""


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else can only be meant as a local path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def load_model(
    name_or_dir: str,
    dtype: torch.dtype = torch.float32,
    *,
    device: torch.device | str | None = None,
    attn_implementation: str | None = None,
):
    """Load (model, tokenizer) from a local HF model directory or a hub name: weights in
    ``dtype``, moved to ``device`` (default: left on the CPU), with ``attn_implementation``
    (default: transformers' choice, SDPA where torch has it)."""
    model, tokenizer = _load_model(str(name_or_dir), dtype, attn_implementation)
    if device is not None and torch.device(device) != model.device:
        model = model.to(device)
    return model, tokenizer


def load_for_inference(name_or_dir: str, precision):
    """(model, tokenizer) to run, not train, at ``precision`` (``models.device.Precision``):
    on its device, its weights stored as :meth:`Precision.storage_dtype` says, in eval mode,
    tagged so that every forward pass runs under the precision's autocast."""
    from serl_cli.models.device import tag

    model, tokenizer = load_model(
        name_or_dir,
        precision.storage_dtype(training=False),
        device=precision.device,
        attn_implementation=precision.attn_implementation,
    )
    return tag(model.eval(), precision), tokenizer


def _load_model(name: str, dtype: torch.dtype, attn_implementation: str | None):
    path = Path(name).expanduser()
    local = path.exists() or _looks_like_path(name)
    if local:
        if not path.exists():
            raise ModelError(f"model directory {name} does not exist")
        if not path.is_dir():
            raise ModelError(f"model path {name} is a file, not a model directory")
        if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
            return load_adapter_model(
                path, dtype, attn_implementation
            )  # a LoRA adapter-only checkpoint: base + adapter
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {name} has no config.json: not a Hugging Face model")
        source = str(path)
    else:
        source = name
        if not is_offline_mode() and not _cached(name):
            _check_hub_reachable(name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, **extra)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # SafetensorError: truncated or corrupt weights
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if local:
            raise ModelError(f"cannot load model directory {name}: {first}") from None
        offline = " (HF_HUB_OFFLINE is set and it is not cached)" if is_offline_mode() else ""
        raise ModelError(
            f"cannot load model {name!r}: no such local directory and not loadable "
            f"from the Hugging Face hub{offline}: {first}"
        ) from None
    check_tokenizer(tokenizer, name)
    return model, tokenizer


MIN_VOCABULARY = 16  # fewer tokens than this is no tokenizer: transformers makes a 1-token one from nothing


def check_tokenizer(tokenizer, name: str) -> None:
    """Refuse, by name, a model whose tokenizer files are missing or broken: transformers then
    builds a tokenizer of one or two tokens from the config alone, and generation fails deep
    inside (an index out of range) after the run directory was written."""
    if len(tokenizer) < MIN_VOCABULARY:
        raise ModelError(
            f"model {name} has no usable tokenizer: it loads with {len(tokenizer)} token(s) (is tokenizer.json, "
            f"or vocab.json and merges.txt, missing?)"
        )


def _cached(name: str) -> bool:
    """Whether a hub model's config is already in the local cache (then no network is needed)."""
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(name, "config.json"), str)


def _check_hub_reachable(name: str, timeout_s: float = 3.0) -> None:
    """Fail in seconds, not after a minute of retries, when the hub cannot be reached. The
    probe (name lookup + TCP connect) runs in a thread, so a silent resolver cannot hang it."""
    import socket
    from concurrent.futures import ThreadPoolExecutor
    from concurrent.futures import TimeoutError as Timeout
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        pool.submit(lambda: socket.create_connection((url.hostname, port), timeout=timeout_s).close()).result(timeout_s)
        return
    except Timeout:
        reason = f"no answer in {timeout_s:g} s"
    except OSError as e:
        reason = e.strerror or type(e).__name__
    finally:
        pool.shutdown(wait=False)
    raise ModelError(
        f"cannot load model {name!r}: no such local directory, not in the Hugging Face cache, and the hub "
        f"({constants.ENDPOINT}) is unreachable ({reason}): pass a local model directory, download it "
        f"where there is network, or set HF_HUB_OFFLINE=1 to use only the local cache"
    )


def set_torch_threads(n: int | None) -> None:
    """``n`` threads; unset: ``$SERL_THREADS`` if set (the tests set 1), else :func:`default_threads`."""
    torch.set_num_threads(n or env_threads() or default_threads())


def env_threads() -> int | None:
    """``$SERL_THREADS``: a count of at least 1, or None where it is unset or empty; anything
    else is refused in one line (not a ValueError from int())."""
    raw = os.environ.get("SERL_THREADS", "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise SerlError(f"SERL_THREADS must be a whole number of threads, at least 1 (or unset), got {raw!r}")
    return n


def default_threads() -> int:
    """The CPUs this process may run on (its affinity: a Slurm allocation, ``taskset``), not the
    machine's count, shared evenly by the processes a launcher started on this node
    (``LOCAL_WORLD_SIZE`` from torchrun, ``LOCAL_SIZE`` from the deepspeed launcher): eight ranks
    each taking every core would oversubscribe the node eight times."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("LOCAL_SIZE") or 1)
    return max(1, cpus // max(local, 1))


ADAPTER_CONFIG = "adapter_config.json"


ADAPTER_SUBDIR = "adapter"  # where a merged checkpoint keeps the adapter it was merged from


def import_peft():
    require_peft()
    import peft

    return peft


def adapter_dir(checkpoint: str | Path) -> Path | None:
    """The adapter a checkpoint carries: ``adapter/`` of a merged one, the directory itself
    of an adapter-only one; None for a plain model."""
    path = Path(checkpoint)
    for d in (path / ADAPTER_SUBDIR, path):
        if (d / ADAPTER_CONFIG).is_file():
            return d
    return None


def base_model_name(adapter: Path) -> str:
    try:
        name = json.loads((adapter / ADAPTER_CONFIG).read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, json.JSONDecodeError) as e:
        raise SerlError(f"cannot read {adapter / ADAPTER_CONFIG}: {e}") from None
    if not name:
        raise SerlError(f"{adapter / ADAPTER_CONFIG} names no base model (base_model_name_or_path)")
    return name


def load_adapters(model, adapter: Path, trainable: bool):
    """``model`` (the base) with the saved adapter from ``adapter`` applied."""
    peft = import_peft()
    return peft.PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable)


def load_adapter_model(path: str | Path, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None):
    """(model, tokenizer) of an adapter-only checkpoint: its base model plus the adapter,
    merged for inference (eval and rollouts load these unchanged)."""
    from transformers import AutoTokenizer

    from serl_cli.models.loading import load_model

    path = Path(path)
    model, _ = load_model(base_model_name(path), dtype, attn_implementation=attn_implementation)
    model = load_adapters(model, path, trainable=False).merge_and_unload()
    return model, AutoTokenizer.from_pretrained(str(path))


def require_peft() -> None:
    if importlib.util.find_spec("peft") is None:
        raise SerlError("LoRA (--lora-rank > 0) needs peft: pip install 'serl[lora]'")
