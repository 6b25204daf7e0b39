"""Small Qwen2-architecture causal LMs built offline: the tests' and the demo's models.

The tokenizer is a byte-level BPE trained on environment text with exactly the pipeline
that transformers' `Qwen2Tokenizer` rebuilds (NFC, Split on Qwen2's regex, ByteLevel), so
the ids are the same whichever class `AutoTokenizer` picks when the directory is loaded.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

from serl_cli.artifacts.io import follow_umask
from serl_cli.models.loading import ModelError

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"


# Qwen-style ChatML; no default system prompt so rendered prompts are exactly what callers pass.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Tied embeddings (the vocab matrix is the largest block at this scale). head_dim 64 (micro: 32), GQA 2:1.
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
    # ~0.9M params: 4 x 0.2M layers and at most 0.13M embedding. The Sokoban demo's: small
    # enough that an online iteration (8 rooms x 8) runs in seconds on one CPU thread
    "micro": dict(
        _COMMON,
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~4.2M params: 1.05M embedding + 4 x 0.79M layers
    "tiny": dict(
        _COMMON,
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    # ~25.4M params: 4.2M embedding + 6 x 3.54M layers
    "small": dict(
        _COMMON,
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1792,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
    ),
}


def _qwen2_pipeline(tok: Tokenizer) -> Tokenizer:
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
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


def init_model(preset: str, out_dir: str | Path, texts: Iterable[str], seed: int = 0, overwrite: bool = False) -> Path:
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
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, bos_token_id=None
    )

    out.parent.mkdir(parents=True, exist_ok=True)
    # A sibling temp dir lives on the same filesystem, so the final rename is atomic and a
    # crash mid-save never leaves a half-written model under `out`.
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        follow_umask(tmp)  # mkdtemp and safetensors make 0700/0600
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


def count_parameters(model: torch.nn.Module) -> int:
    """Unique parameters (tied embedding/lm_head counted once)."""
    return sum(p.numel() for p in model.parameters())
