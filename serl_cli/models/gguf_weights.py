"""A GGUF file's weights as a Hugging Face model: the file checked and described (architecture, tensor
types, hash) without loading it, then loaded by transformers (dequantized, with the ``gguf`` extra) and
saved in the dtype asked for, with its tokenizer, chat template and a generation config that stops at
the end of an assistant turn. Where the file comes from is :mod:`serl_cli.models.fetch`'s business."""

from __future__ import annotations

import collections
import functools
import importlib.metadata
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from serl_cli.artifacts import io
from serl_cli.errors import SerlError

GGUF_MAGIC = b"GGUF"
DTYPE_WORDS = ("bf16", "fp16", "fp32")  # serl's words for a dtype (models.choices), as saved on disk


@dataclass(frozen=True)
class GgufInfo:
    """What a GGUF file says of itself, read before transformers loads it."""

    path: Path
    sha256: str
    architecture: str
    name: str | None
    tensor_types: dict[str, int]  # GGML type -> how many tensors are stored in it (Q4_1: 210)


def inspect_gguf(path: Path, expected_sha256: str | None = None) -> GgufInfo:
    """Read ``path``'s header and tensor table: not a GGUF, cut short or damaged, no
    architecture, or a sha256 other than ``expected_sha256`` are each one line."""
    try:
        with open(path, "rb") as f:
            magic = f.read(len(GGUF_MAGIC))
        digest = io.file_sha256(path)
    except OSError as e:
        raise SerlError(f"cannot read {path}: {e.strerror or e}") from None
    if magic != GGUF_MAGIC:
        raise SerlError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    if expected_sha256 is not None and digest != expected_sha256:
        raise SerlError(f"{path} has sha256 {digest}, not the {expected_sha256} given with --sha256")
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf reports a short file as whatever numpy or struct failed on
        raise SerlError(f"{path} is truncated or damaged: gguf cannot read it ({_first_line(e)})") from None
    size = path.stat().st_size
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise SerlError(f"{path} is truncated: its tensors end at byte {end:,}, the file at {size:,}")
    architecture = _field(reader, "general.architecture")
    if not architecture:
        raise SerlError(f"{path} names no architecture (general.architecture): not a model GGUF")
    kinds = collections.Counter(t.tensor_type.name for t in reader.tensors)
    return GgufInfo(path, digest, str(architecture), _field(reader, "general.name"), dict(kinds))


def _field(reader, key: str) -> Any:
    field = reader.fields.get(key)
    return field.contents() if field is not None else None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# -- the conversion -----------------------------------------------------------------------------------


def convert(info: GgufInfo, into: Path, dtype: str, end_of_turn: Callable[[Any], int]) -> dict:
    """The GGUF as a Hugging Face model directory in ``into``: safetensors in ``dtype`` (bf16,
    fp16 or fp32), the tokenizer with its chat template, and a generation config that stops at
    ``end_of_turn(tokenizer)`` and at the eos token. Returns the figures the provenance records."""
    import torch

    from serl_cli.models.loading import quiet_transformers

    quiet_transformers()  # no "Loading weights" bars; and serl's CLI keeps dequantization's off
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    with _quiet_dequantization():
        tokenizer, model = _load(info, torch_dtype)
    model = _plain(model, torch_dtype)
    tokenizer.model_max_length = model.config.max_position_embeddings  # the GGUF loader leaves it unbounded
    stop = sorted({end_of_turn(tokenizer), tokenizer.eos_token_id} - {None})
    model.generation_config = _generation_config(tokenizer, stop)
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "vocabulary": len(tokenizer),
        "stop_token_ids": stop,
        "stop_tokens": tokenizer.convert_ids_to_tokens(stop),
        "model_class": type(model).__name__,
    }


def _load(info: GgufInfo, torch_dtype):
    """(tokenizer, model) as transformers reads the GGUF, every weight dequantized; what it
    refuses (an architecture it does not know, a tokenizer it cannot build) is one line."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(info.path.parent), info.path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype, **_dequantized())
    except (ValueError, KeyError, NotImplementedError, OSError, RuntimeError) as e:  # RuntimeError: shapes
        raise SerlError(
            f"transformers {package_version('transformers')} cannot load {info.path} (architecture "
            f"{info.architecture!r}) as a causal LM: {_first_line(e)}"
        ) from None
    return tokenizer, model


@contextmanager
def _quiet_dequantization() -> Iterator[None]:
    """transformers draws its "de-quantizing GGUF tensors" bar with tqdm itself, past the switch
    serl turns its bars off with (:func:`~serl_cli.models.loading.quiet_transformers`): that
    switch holds here too, so that a log file gets no bar."""
    from transformers.utils import logging as transformers_logging

    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_loading
    except ImportError:
        yield
        return
    bar = getattr(gguf_loading, "tqdm", None)
    if bar is None or transformers_logging.is_progress_bar_enabled():
        yield
        return
    gguf_loading.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_loading.tqdm = bar


def _dequantized() -> dict:
    """Ask for dense weights: with a GGUF matmul kernel installed, transformers would otherwise
    keep the quantized blocks, which no serl engine runs and save_pretrained refuses."""
    try:
        from transformers import GgufConfig
    except ImportError:  # a transformers without it dequantizes every GGUF
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _plain(model, torch_dtype):
    """The same weights in a model of the same class that carries no GGUF quantization config,
    so that it saves as a plain checkpoint (transformers refuses to save one it loaded quantized).
    Built on the meta device and given the loaded tensors: no second copy, no random init."""
    import torch

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch_dtype
    with torch.device("meta"):
        plain = type(model)(config)
    state = model.state_dict()
    packed = [k for k, v in state.items() if not v.is_floating_point()]
    if packed:  # a transformers that kept GGUF blocks despite dequantize=True
        raise SerlError(f"transformers kept {packed[0]} quantized (not dense floats): cannot save it")
    plain.load_state_dict({k: v.to(torch_dtype) for k, v in state.items()}, strict=True, assign=True)
    plain.tie_weights()
    return plain.eval()


def _generation_config(tokenizer, stop: list[int]):
    from transformers import GenerationConfig

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    return GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop, pad_token_id=pad)


def package_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None
