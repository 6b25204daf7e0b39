"""Small Qwen2-architecture causal LMs built offline, plus loading helpers.

The tokenizer is a byte-level BPE trained on environment text with exactly the pipeline
that transformers' `Qwen2Tokenizer` rebuilds (NFC, Split on Qwen2's regex, ByteLevel), so
the ids are the same whichever class `AutoTokenizer` picks when the directory is loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable

import torch
from huggingface_hub import is_offline_mode
from safetensors import SafetensorError
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)
# Import (not copy) the regex: if transformers changes what Qwen2Tokenizer rebuilds, we follow.
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from serl_cli.errors import SerlError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"

# Qwen-style ChatML; no default system prompt so rendered prompts are exactly what callers pass.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Tied embeddings (the vocab matrix is the largest block at this scale). head_dim 64, GQA 2:1.
# max_position_embeddings only bounds RoPE positions (no parameters), so keep it generous
# for long WebShop pages. Parameter counts are stated in tests/test_model.py.
_COMMON = dict(
    hidden_act="silu",
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    tie_word_embeddings=True,
    use_cache=True,
)
PRESETS: dict[str, dict] = {
    # ~4.2M params: 1.05M embedding + 4 x 0.79M layers
    "tiny": dict(_COMMON, vocab_size=4096, hidden_size=256, intermediate_size=768,
                 num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    # ~25.4M params: 4.2M embedding + 6 x 3.54M layers
    "small": dict(_COMMON, vocab_size=8192, hidden_size=512, intermediate_size=1792,
                  num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4),
}


class ModelError(SerlError, ValueError):
    """A model name or directory that cannot be used; the message is one line for the CLI."""


def _qwen2_pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`. Deterministic: same texts and size -> same vocab."""
    # No unk token: the full 256-byte alphabet is seeded, so every string encodes.
    tok = _qwen2_pipeline(Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False)))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,  # ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    # The trainer leaves these as None; Qwen2Tokenizer rebuilds with "". Same behaviour, but
    # matching makes the saved and the reloaded backends serialize identically (tested).
    tok.model.continuing_subword_prefix = tok.model.end_of_word_suffix = ""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # decode must give back the exact text
    )


def build_config(preset: str, tokenizer=None) -> Qwen2Config:
    if preset not in PRESETS:
        raise ModelError(f"unknown preset {preset!r}: choose one of {', '.join(PRESETS)}")
    cfg = Qwen2Config(**PRESETS[preset])
    if tokenizer is not None:
        # A small corpus gives fewer merges than asked: the model gets exactly the tokenizer's
        # ids, so it can never sample one that decodes to nothing.
        cfg.vocab_size = len(tokenizer)  # no embedding rows for ids the tokenizer cannot decode
        cfg.eos_token_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
        cfg.pad_token_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    return cfg


def init_model(preset: str, out_dir: str | Path, texts: Iterable[str], seed: int = 0,
               overwrite: bool = False) -> Path:
    """Train a tokenizer, randomly init a Qwen2 model and save both to `out_dir` atomically."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise ModelError(f"{out} already exists and is not empty: pass overwrite=True to replace it")
    tokenizer = train_tokenizer(texts, build_config(preset).vocab_size)  # validates preset first
    config = build_config(preset, tokenizer)
    tokenizer.model_max_length = config.max_position_embeddings
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None)

    out.parent.mkdir(parents=True, exist_ok=True)
    # A sibling temp dir lives on the same filesystem, so the final rename is atomic and a
    # crash mid-save never leaves a half-written model under `out`.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old) if old.is_dir() else old.unlink()
        else:
            tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


def _looks_like_path(name: str) -> bool:
    # Hub ids are "name" or "org/name"; anything else can only be meant as a local path.
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (os.sep != "/" and os.sep in name)


def load_model(name_or_dir: str, dtype: torch.dtype = torch.float32):
    """Load (model, tokenizer) from a local HF model directory or a hub name."""
    name = str(name_or_dir)
    path = Path(name).expanduser()
    local = path.exists() or _looks_like_path(name)
    if local:
        if not path.exists():
            raise ModelError(f"model directory {name} does not exist")
        if not path.is_dir():
            raise ModelError(f"model path {name} is a file, not a model directory")
        if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
            from serl_cli.lora import load_adapter_model  # a LoRA adapter-only checkpoint: its base + the adapter

            return load_adapter_model(path, dtype)
        if not (path / "config.json").is_file():
            raise ModelError(f"model directory {name} has no config.json: not a Hugging Face model")
        source = str(path)
    else:
        source = name
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except (OSError, ValueError, KeyError, SafetensorError) as e:  # SafetensorError: truncated or corrupt weights
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if local:
            raise ModelError(f"cannot load model directory {name}: {first}") from None
        offline = " (HF_HUB_OFFLINE is set and it is not cached)" if is_offline_mode() else ""
        raise ModelError(f"cannot load model {name!r}: no such local directory and not loadable "
                         f"from the Hugging Face hub{offline}: {first}") from None
    return model, tokenizer


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embedding/lm_head counted once)."""
    return sum(p.numel() for p in model.parameters())


def set_torch_threads(n: int | None) -> None:
    """``n`` threads; unset: ``$SERL_THREADS`` if set (the tests set 1), else every core."""
    torch.set_num_threads(n or int(os.environ.get("SERL_THREADS") or 0) or os.cpu_count() or 1)
