"""Tests for serl_cli.models (tiny, loading): presets, offline tokenizer round trip, init determinism, loading."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub import

import json
import unicodedata

import huggingface_hub.constants
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2ForCausalLM

from serl_cli.models.loading import ModelError, load_model
from serl_cli.models.tiny import SPECIAL_TOKENS, build_config, count_parameters, init_model, train_tokenizer

torch.set_num_threads(1)

_PRODUCTS = [
    "long clip-in hair extension",
    "blue wireless bluetooth headphones",
    "gluten free vegan protein bars",
    "men's slim fit cotton t-shirt",
    "stainless steel water bottle 32 oz",
    "organic green tea bags",
    "women's running shoes size 8",
    "led desk lamp with usb charging port",
]
CORPUS = [
    line
    for i, p in enumerate(_PRODUCTS)
    for line in (
        f"WebShop [SEP] Instruction: [SEP] i need a {p}, and price lower than {20 + 10 * i}.00 dollars [SEP] Search",
        f"search[{p}]",
        f"Instruction: [SEP] {p} [SEP] Back to Search [SEP] Page 1 (Total results: 50) [SEP] Next > "
        f"[SEP] B0{i}QQP33{i}6 [SEP] {p.title()} [SEP] ${12 + i}.99",
        f"click[b0{i}qqp33{i}6]",
        "click[buy now]",
        "click[< prev]",
        "Thought: the item matches the color and size.\nAction: click[buy now]",
    )
]

ROUND_TRIP = [
    "",
    "search[long clip-in hair extension]",
    "click[buy now]",
    "WebShop [SEP] Instruction: [SEP] i need a red dress under 30.00 dollars [SEP] Search",
    "prices: $1,234.56 or 0.99 -- 12345678901234567890",
    "  leading spaces,   multiple   spaces, trailing  ",
    "line one\nline two\r\n\n\n\ttabbed\n",
    "unicode: café naïve Zürich, 日本語のテキスト, Ελληνικά, русский, emoji 🤖🛒👍🏽",
    "decomposed e\u0301 and full-width ＡＢＣ１２３ and \u00a0nbsp, zero\u200bwidth",
    "control bytes \x00\x01\x7f",
    "I'LL can't we've they'RE",
    "<|im_start|>user\nbuy the blue headphones<|im_end|>\n<|im_start|>assistant\nsearch[blue headphones]<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, 4096)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny", CORPUS, seed=0)


def _pipeline(tok):
    data = json.loads(tok.backend_tokenizer.to_str())
    return {k: data[k] for k in ("normalizer", "pre_tokenizer", "decoder", "model")}


@pytest.mark.parametrize("preset,target", [("tiny", 4e6), ("small", 25e6)])
def test_preset_parameter_counts(preset, target):
    cfg = build_config(preset)
    assert cfg.max_position_embeddings >= 4096 and cfg.tie_word_embeddings
    with torch.device("meta"):  # config-only: no memory, no init cost
        model = Qwen2ForCausalLM(cfg)
    n = count_parameters(model)
    assert 0.7 * target <= n <= 1.3 * target, n
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_unknown_preset():
    with pytest.raises(ModelError, match="huge"):
        build_config("huge")


def test_tokenizer_special_tokens_and_determinism(tokenizer):
    assert tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS) == [0, 1, 2]
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.unk_token is None and tokenizer.bos_token is None
    assert train_tokenizer(CORPUS, 4096).backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    # the full byte alphabet is present, so nothing is ever unknown
    assert len(tokenizer) > 256 + len(SPECIAL_TOKENS)


def test_tokenizer_round_trip_through_auto_tokenizer(tokenizer, tiny_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # transformers 5 maps model_type qwen2 to Qwen2Tokenizer, which rebuilds its own pipeline
    # from vocab+merges; a plain fast-tokenizer load reads tokenizer.json verbatim. Both must agree.
    auto = AutoTokenizer.from_pretrained(tiny_dir)
    plain = PreTrainedTokenizerFast.from_pretrained(tiny_dir)
    for loaded in (auto, plain):
        assert _pipeline(loaded) == _pipeline(tokenizer)
        assert loaded.eos_token == "<|im_end|>" and loaded.pad_token == "<|endoftext|>"
    for text in ROUND_TRIP:
        ids = tokenizer(text)["input_ids"]
        assert auto(text)["input_ids"] == ids, text
        assert plain(text)["input_ids"] == ids, text
        assert all(0 <= i < len(tokenizer) for i in ids)
        # NFC is part of the pipeline, so decoding returns the NFC form of the input
        assert auto.decode(ids) == unicodedata.normalize("NFC", text), text
    chat_ids = auto(ROUND_TRIP[-1])["input_ids"]
    assert chat_ids[0] == 1 and chat_ids.count(2) == 2  # special tokens stay single ids


def test_chat_template(tiny_dir):
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    messages = [
        {"role": "system", "content": "You are a shopping agent."},
        {"role": "user", "content": "WebShop [SEP] Instruction: [SEP] i need a lamp [SEP] Search"},
        {"role": "assistant", "content": "search[lamp]"},
    ]
    expected = (
        "<|im_start|>system\nYou are a shopping agent.<|im_end|>\n"
        "<|im_start|>user\nWebShop [SEP] Instruction: [SEP] i need a lamp [SEP] Search<|im_end|>\n"
        "<|im_start|>assistant\nsearch[lamp]<|im_end|>\n"
    )
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    prompt = tok.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_init_model_is_deterministic(tiny_dir, tmp_path):
    again = init_model("tiny", tmp_path / "again", CORPUS, seed=0)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    other = init_model("tiny", tmp_path / "other", CORPUS, seed=1)
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_init_model_refuses_to_overwrite(tmp_path):
    out = tmp_path / "m"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ModelError, match="not empty"):
        init_model("tiny", out, CORPUS)
    init_model("tiny", out, CORPUS, overwrite=True)
    assert (out / "config.json").is_file() and not (out / "keep.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or backup dirs left


def test_load_model_errors(tmp_path, monkeypatch):
    missing = tmp_path / "nope"
    with pytest.raises(ModelError, match=f"{missing}.*does not exist"):
        load_model(str(missing))
    (tmp_path / "notes.txt").write_text("hi")
    with pytest.raises(ModelError, match=f"{tmp_path}.*no config.json"):
        load_model(str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    for name in ("runs/x", "serl-test-org/not-a-cached-model"):
        with pytest.raises(ModelError, match=f"'{name}'.*HF_HUB_OFFLINE") as info:
            load_model(name)
        assert "\n" not in str(info.value)


def test_loaded_tiny_model_generates(tiny_dir):
    model, tok = load_model(str(tiny_dir))
    assert isinstance(model, Qwen2ForCausalLM) and model.dtype == torch.float32
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert model.generation_config.pad_token_id == tok.pad_token_id == 0
    assert abs(count_parameters(model) - 4e6) < 0.3 * 4e6
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "search[lamp]"}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=4, do_sample=False)
    n = prompt["input_ids"].shape[1]
    assert n < out.shape[1] <= n + 4
    assert isinstance(tok.decode(out[0, n:]), str)
    # also loadable by plain AutoModelForCausalLM in bf16
    assert AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.bfloat16).dtype == torch.bfloat16
