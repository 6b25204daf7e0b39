"""A causal LM's shape -- hidden size, layers, heads, MLP width, vocabulary -- without loading it.

Read from a model directory's ``config.json`` (an adapter-only LoRA checkpoint: from its base
model's), from the Hugging Face cache for a hub name, or from :data:`KNOWN_SHAPES` (published
``config.json`` values of the models serl's recipes name) when neither is at hand. Neither torch
nor transformers is imported: ``serl plan`` and ``serl train``'s memory check read it in
milliseconds. Parameter counts are those of the Llama/Qwen2 decoder (attention with optional q/k/v
biases, a SwiGLU MLP, RMSNorms), which every model serl trains has.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from serl_cli.errors import SerlError


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool = False  # the output head shares the embedding matrix
    head_dim: int = 0  # 0: hidden / heads
    qkv_bias: bool = True  # Qwen2's q/k/v projections carry biases; Llama's do not
    name: str = ""

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def kv_width(self) -> int:
        """Features of K (or V) per token: key-value heads x head dimension."""
        return self.kv_heads * self.dim

    @property
    def layer_params(self) -> int:
        """Parameters of one decoder layer."""
        q, kv = self.heads * self.dim, self.kv_width
        attention = self.hidden * (q + 2 * kv) + q * self.hidden + ((q + 2 * kv) if self.qkv_bias else 0)
        return attention + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        head = 0 if self.tied else self.embedding_params
        return self.embedding_params + head + self.layers * self.layer_params + self.hidden

    @property
    def largest_tensor(self) -> int:
        """Elements of the largest single weight (the embedding, or an MLP matrix)."""
        return max(self.embedding_params, self.hidden * self.intermediate)


def _shape(name, hidden, layers, heads, kv_heads, intermediate, vocab, tied) -> ModelShape:
    return ModelShape(hidden, layers, heads, kv_heads, intermediate, vocab, tied, name=name)


# config.json of the published checkpoints (the -Instruct models share their base's shape)
KNOWN_SHAPES = {
    "Qwen/Qwen2.5-0.5B": _shape("Qwen/Qwen2.5-0.5B", 896, 24, 14, 2, 4864, 151936, True),
    "Qwen/Qwen2.5-1.5B": _shape("Qwen/Qwen2.5-1.5B", 1536, 28, 12, 2, 8960, 151936, True),
    "Qwen/Qwen2.5-3B": _shape("Qwen/Qwen2.5-3B", 2048, 36, 16, 2, 11008, 151936, True),
    "Qwen/Qwen2.5-7B": _shape("Qwen/Qwen2.5-7B", 3584, 28, 28, 4, 18944, 152064, False),
    "Qwen/Qwen2.5-14B": _shape("Qwen/Qwen2.5-14B", 5120, 48, 40, 8, 13824, 152064, False),
}


def shape_from_config(config: dict, name: str = "") -> ModelShape:
    """The shape a transformers ``config.json`` describes (a multimodal one: its ``text_config``)."""
    config = config.get("text_config") or config
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        shape = ModelShape(
            hidden=hidden,
            layers=int(config["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(config.get("num_key_value_heads") or heads),
            intermediate=int(config["intermediate_size"]),
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            head_dim=int(config.get("head_dim") or 0),
            qkv_bias=bool(config.get("attention_bias", config.get("model_type") in ("qwen2", "qwen2_moe"))),
            name=name,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise SerlError(f"{name or 'the model'}'s config.json lacks what a size needs ({e})") from None
    return shape


def known_shape(name: str) -> ModelShape | None:
    """A hub name's shape from :data:`KNOWN_SHAPES` (``-Instruct`` and other suffixes after the size ignored)."""
    for key, shape in KNOWN_SHAPES.items():
        if name == key or name.startswith(key + "-"):
            return shape
    return None


def model_shape(name: str) -> ModelShape:
    """The shape of ``name``: a model directory, an adapter-only checkpoint (its base), a hub
    name in the local cache or in :data:`KNOWN_SHAPES`."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return shape_from_config(_read(path / "config.json"), str(path))
        if (path / "adapter_config.json").is_file():
            base = _read(path / "adapter_config.json").get("base_model_name_or_path")
            if base:
                return model_shape(base)
        raise SerlError(f"model directory {name} has no config.json: its size is unknown")
    cached = _cached_config(name)
    if cached is not None:
        return shape_from_config(_read(Path(cached)), name)
    shape = known_shape(name)
    if shape is None:
        raise SerlError(
            f"cannot size model {name!r}: no such directory, not in the Hugging Face cache, and not one of "
            f"{', '.join(KNOWN_SHAPES)}; pass a local model directory"
        )
    return shape


def vocabulary(name: str) -> int | None:
    """The vocabulary size ``name``'s config declares; None where it cannot be told without loading."""
    try:
        return model_shape(name).vocab
    except SerlError:
        return None


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise SerlError(f"cannot read {path}: {e}") from None


def _cached_config(name: str) -> str | None:
    if name.count("/") > 1 or name.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # an unusual name the cache lookup refuses: not cached
        return None
    return found if isinstance(found, str) else None
