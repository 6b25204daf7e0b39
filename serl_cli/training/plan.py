"""How much memory one rank needs for an iteration, item by item, before anything is loaded.

``serl plan`` prints the result and ``serl train`` refuses a layout that cannot fit. The pieces
(model states, activations, logits, KV cache) are :mod:`serl_cli.training.memory`'s; here they
are added up per phase of an iteration, per rank:

* **start**: loading and wrapping the model;
* **generate**: the resident states plus the hf engine's KV cache and prefill (under ZeRO-3
  with the weights gathered), or vLLM's ``gpu_memory_utilization`` share of a GPU it shares;
* **score**: pi_old and the teacher, forward passes without gradients. The teacher is, under
  ZeRO-3, sharded like the policy (1/N of its 16-bit weights, always on the GPU); under ZeRO-1/2
  and torch held in CPU memory and on the GPU (whole, 16-bit) only while it scores;
* **update**: the resident states plus one micro-batch's activations and logits;
* **save**: a checkpoint written: the resident states plus, under ZeRO-3, the whole 16-bit
  model gathered on every rank (``Learner.save`` writes the Hugging Face files inside
  ``full_model()``, a ``GatheredParameters`` over every weight: each rank's GPU holds all of
  them, not only rank 0's), and under LoRA saved merged rank 0's merged copy;

each with the CUDA runtime (context, NCCL buffers). The peak is the largest phase; a layout
fits with headroom when it is at most 90 % of the GPU's memory. Also: one GPU of vLLM's own
(its weights' shard, workspace and KV cache), the disk of one checkpoint and of a whole run
(the checkpoints kept, the final policy, every iteration's rollouts and annotations, which
are never pruned), the CPU memory of a node. ``device="cpu"`` describes the CPU runs that
``benchmarks/plan_check.py`` measures to validate the estimate (there DeepSpeed's buffers are
touched, not reserved, and the model file's pages count while it loads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from serl_cli.models.shapes import ModelShape
from serl_cli.training.memory import (
    GiB,
    Item,
    Layout,
    activation_bytes,
    forward_bytes,
    kv_bytes_per_token,
    logit_bytes,
    logit_positions,
    model_states,
    persistent_params,
    trainable_params,
)

HEADROOM = 0.10  # a layout "fits" when its peak leaves this much of the GPU free
CUDA_RUNTIME = 1.25 * GiB  # CUDA context (~0.5-0.8 GB) and NCCL's communicator buffers, per GPU
VLLM_WORKSPACE = 2.0 * GiB  # vLLM's profiled activations, sampler and CUDA graphs, per GPU
# A colocated engine's worker keeps its CUDA context outside its gpu_memory_utilization share, and through
# sleep mode (level 2 frees the weights and the KV cache) also its CUDA-graph pool and communication
# buffers: 1-2 GiB per GPU by a reading of vLLM 0.32's sleep mode, taken at its middle
VLLM_CONTEXT = 0.75 * GiB
VLLM_KEPT_ASLEEP = 0.75 * GiB


@dataclass
class Phase:
    name: str
    items: list[Item]

    @property
    def bytes(self) -> float:
        return sum(i.bytes for i in self.items)


@dataclass
class Plan:
    shape: ModelShape
    layout: Layout
    phases: list[Phase]
    vllm: list[Item] = field(default_factory=list)  # one GPU of vLLM's own (split layout)
    disk: list[Item] = field(default_factory=list)  # one checkpoint
    run_disk: list[Item] = field(default_factory=list)  # the whole run (needs a Storage)
    host: list[Item] = field(default_factory=list)  # CPU memory of one node
    problems: list[str] = field(default_factory=list)  # why the layout cannot run, one line each

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.bytes)

    @property
    def headroom(self) -> float:
        return 1 - self.peak.bytes / self.layout.gpu_bytes

    @property
    def verdict(self) -> str:
        if self.problems:
            return "does not fit"
        return "fits" if self.headroom >= HEADROOM else "tight"


def runtime(layout: Layout) -> list[Item]:
    return [Item("CUDA runtime", CUDA_RUNTIME, "context, NCCL buffers")] if layout.device == "cuda" else []


# -- the phases -----------------------------------------------------------------------------------
def teacher_resident(shape: ModelShape, layout: Layout) -> list[Item]:
    if not layout.teacher or layout.lora_rank > 0:
        return []
    if layout.sharded:
        return [Item("teacher", 2 * shape.params / layout.ranks, f"sharded like the policy: 1/{layout.ranks}")]
    return []


def reference_resident(shape: ModelShape, layout: Layout) -> list[Item]:
    if not layout.reference:
        return []
    return [Item("KL reference", layout.module_bytes * shape.params, "a frozen copy")]


def producer_items(shape: ModelShape, layout: Layout) -> list[Item]:
    """``max_staleness > 0``: the producer process generates on the trainer's device while the
    trainer scores, updates and saves -- its own copy of the policy, its KV cache and prefill."""
    if layout.staleness <= 0 or not layout.generates or layout.engine_owns_weights:
        return []
    gen = [i for i in generation_items(shape, layout) if i.name != "gathered weights"]
    copy = Item("producer's policy", layout.module_bytes * shape.params, "its own copy, in its own process")
    return [copy] + [Item(f"producer's {i.name}", i.bytes, i.note) for i in gen]


def phases(shape: ModelShape, layout: Layout) -> list[Phase]:
    resident = model_states(shape, layout) + teacher_resident(shape, layout) + reference_resident(shape, layout)
    resident += runtime(layout) + producer_items(shape, layout)
    # a colocated vLLM starts before the trainer loads (online.loop) and sleeps only later
    awake = [Item("vLLM (colocated, awake)", layout.vllm_utilization * layout.gpu_bytes, "started first")]
    awake += vllm_context(layout)
    out = [Phase("start", start_items(shape, layout) + (awake if layout.colocated else []) + runtime(layout))]
    if layout.generates and layout.staleness <= 0:  # else the producer generates, beside every phase
        out.append(Phase("generate", resident + generation_items(shape, layout)))
    scoring = [Item("forward pass", forward_bytes(shape, layout), "pi_old, teacher: no gradients")]
    if layout.teacher and layout.lora_rank == 0 and not (layout.sharded):
        scoring.append(Item("teacher on the GPU", 2 * shape.params, "moved in from CPU memory while it scores"))
    if layout.teacher and layout.lora_rank == 0 and layout.sharded:  # teacher.scoring's clone of the live shard
        aside = Item("policy set aside", zero3_shard_bytes(shape, layout), "the live shard while the teacher scores")
        scoring.append(aside)
    out.append(Phase("score", resident + scoring + vllm_asleep(layout)))
    update = [
        Item(
            "activations",
            activation_bytes(shape, layout, layout.gradient_checkpointing),
            "checkpointed" if layout.gradient_checkpointing else "no checkpointing",
        ),
        Item("logits", logit_bytes(shape, layout, backward=True), f"{logit_positions(layout)} positions + gradient"),
    ]
    out.append(Phase("update", resident + update + vllm_asleep(layout)))
    out.append(Phase("save", resident + save_items(shape, layout) + vllm_asleep(layout)))
    return out


def save_items(shape: ModelShape, layout: Layout) -> list[Item]:
    """What writing a checkpoint adds on a rank. Under ZeRO-3 ``Learner.save`` gathers every
    weight whole on every rank (``full_model``: DeepSpeed's ``GatheredParameters``, on the
    rank's device) while rank 0 writes the Hugging Face files; DeepSpeed's own checkpoint
    (``save_checkpoint``) writes each rank's partitions as they are, without gathering. Under
    LoRA saved merged, rank 0 also builds the merged weights as new tensors
    (``lora.merged_state_dict``). The safetensors copy to CPU memory is host memory
    (:func:`host_memory`), not the GPU's."""
    w, items = layout.module_bytes, []
    if layout.sharded:
        whole = shape.params - persistent_params(shape)
        items.append(Item("gathered for the save", w * whole, "every rank gathers the whole model"))
    if layout.lora_rank > 0 and layout.lora_merged:
        items.append(Item("merged copy", w * shape.params, "rank 0: W + BA as new tensors"))
    return items


def start_items(shape: ModelShape, layout: Layout) -> list[Item]:
    """Loading and wrapping. On a CPU the model and its file's pages, plus DeepSpeed's flat copy
    at stages 1-2; on a GPU the module moved there and, at stages 1-2, flattened into a copy
    (twice its size for a moment); at stage 3 too the whole module is moved there first (it is
    not built under ``deepspeed.zero.Init``), then partitioned tensor by tensor."""
    p, w = shape.params, layout.module_bytes
    flat = layout.flat_partitioned
    if layout.device == "cpu":
        return [Item("model load", 2 * w * p + (w * p if flat else 0), "weights + the file's pages (+ flat copy)")]
    if layout.sharded:
        # serl loads without deepspeed.zero.Init, so deepspeed.initialize moves the whole module
        # to the GPU (engine._configure_distributed_model) before ZeRO-3 partitions it
        return [Item("model load", w * p, "the module moved whole, then partitioned")]
    return [Item("model load", (2 if flat else 1) * w * p, "the module (+ its flat copy)" if flat else "the module")]


def generation_items(shape: ModelShape, layout: Layout) -> list[Item]:
    if layout.engine_owns_weights:
        if not layout.colocated:
            return []
        share = Item("vLLM (colocated)", layout.vllm_utilization * layout.gpu_bytes, "gpu_memory_utilization")
        return [share, *vllm_context(layout)]
    rows, prompt = layout.rollout_rows, layout.prompt_tokens
    items = []
    if layout.sharded:
        items.append(Item("gathered weights", 2 * shape.params, "the hf engine runs the whole model"))
    kv = kv_bytes_per_token(shape, layout.compute_bytes) * rows * (prompt + layout.reply_tokens)
    items.append(Item("KV cache", kv, f"{rows} rows x {prompt + layout.reply_tokens} tokens"))
    items.append(Item("prefill", layout.compute_bytes * rows * prompt * 3 * shape.intermediate, "the prompts' MLP"))
    return items


def vllm_asleep(layout: Layout) -> list[Item]:
    """A colocated vLLM through the trainer's phases: awake (``sleep`` off, or the producer's engine at
    ``max_staleness > 0``, which generates while the trainer works) its share and its context; asleep its
    context and what sleep mode keeps."""
    if not layout.colocated:
        return []
    if layout.staleness > 0:  # the vLLM producer: its engine generates beside every phase and never sleeps
        awake = Item("vLLM (producer, awake)", layout.vllm_utilization * layout.gpu_bytes, "max_staleness > 0")
        return [awake, *vllm_context(layout)]
    if not layout.vllm_sleep:
        awake = Item("vLLM (colocated, awake)", layout.vllm_utilization * layout.gpu_bytes, "rollout.vllm.sleep is off")
        return [awake, *vllm_context(layout)]
    return [Item("vLLM (colocated, asleep)", VLLM_CONTEXT + VLLM_KEPT_ASLEEP, "CUDA context, graph pool, NCCL buffers")]


def vllm_context(layout: Layout) -> list[Item]:
    """A colocated worker's CUDA context, outside the share ``gpu_memory_utilization`` gives it."""
    return [Item("vLLM's CUDA context", VLLM_CONTEXT, "outside its share")] if layout.colocated else []


def zero3_shard_bytes(shape: ModelShape, layout: Layout) -> float:
    """One rank's 16-bit weights under ZeRO-3: 1/N of the partitioned ones and every persistent one whole."""
    persistent = persistent_params(shape)
    return layout.module_bytes * ((shape.params - persistent) / layout.ranks + persistent)


def vllm_gpu(shape: ModelShape, layout: Layout) -> list[Item]:
    """How vLLM spends its share of one GPU (``gpu_memory_utilization``): the weights' shard, its
    workspace, and what is left for the KV cache."""
    budget = layout.vllm_utilization * layout.gpu_bytes
    weights = 2 * shape.params / layout.vllm_tp
    kv = budget - weights - VLLM_WORKSPACE
    tokens = max(0, int(kv // (kv_bytes_per_token(shape) / layout.vllm_tp)))
    seq = layout.prompt_tokens + layout.reply_tokens
    return [
        Item("weights", weights, f"16-bit, 1/{layout.vllm_tp} (tensor parallel)"),
        Item("workspace", VLLM_WORKSPACE, "activations, sampler, CUDA graphs"),
        Item("KV cache", kv, f"{tokens} tokens: {tokens // max(seq, 1)} sequences of {seq}"),
    ]


def checkpoint_disk(shape: ModelShape, layout: Layout) -> list[Item]:
    """One resumable checkpoint: the Hugging Face weights, the optimizer state, the teacher."""
    p, pt = shape.params, trainable_params(shape, layout)
    w = layout.module_bytes
    items = [Item("model", w * p, "Hugging Face safetensors")]
    if layout.traits.own_checkpoint:
        items.append(Item("DeepSpeed state", 12 * pt, "fp32 master weights + Adam, all partitions"))
    else:
        items.append(Item("optimizer", 8 * pt, "trainer_state.pt: AdamW's moments"))
    if layout.teacher:
        items.append(Item("teacher", 4 * pt if layout.lora_rank > 0 else w * p, "teacher_state.pt"))
    if layout.reference:
        items.append(Item("KL reference", w * p, "trainer_state.pt"))
    return items


def host_memory(shape: ModelShape, layout: Layout) -> list[Item]:
    """CPU memory of one node: each rank loads the model there before it moves to its GPU; the
    offloaded states and a teacher held off the GPU stay there. (A checkpoint save copies the
    gathered weights to rank 0's CPU memory for safetensors, one ``model loading`` share: the
    loading's copies are gone by then, so the sum below covers it.)"""
    k, p, pt = layout.ranks_per_node, shape.params, trainable_params(shape, layout)
    items = [Item("model loading", k * layout.module_bytes * p, f"{k} rank(s) x the loaded model")]
    if layout.offload and layout.traits.offloads:
        items.append(Item("offloaded states", k * 16 * pt / layout.ranks, "fp32 master, Adam, fp32 gradients"))
    if layout.teacher and layout.lora_rank == 0 and not (layout.sharded):
        items.append(Item("teacher", k * 2 * p, "held off the GPU between scorings"))
    return items


# -- the run's disk --------------------------------------------------------------------------------
# Bytes a turn takes in rollouts.jsonl, measured on a tiny Sokoban run (docs/SCALING.md): each
# token id as JSON digits and a comma (the widest id of the vocabulary is assumed: an upper
# bound), each reply token's behaviour log-prob as a JSON float, the reply's text twice (action
# text and parsed action) and the turn's other text (observations, feedback, info).
LOGPROB_JSON = 19  # "-0.6931471805599453," (measured: 19.0 bytes per log-prob)
REPLY_TEXT = 8  # action_text + action: ~4 bytes of text per token each (measured 7.8)
TURN_TEXT = 2048  # observations, feedback, info, keys (measured 0.7 KB on Sokoban's boards; pages are longer)
# annotations.jsonl, per turn: the action mask ("0," per reply token), the teacher's log-probs and
# the weights (a JSON float each), the hindsight block and the fields
ANNOTATION_PER_REPLY_TOKEN = 2 + 2 * LOGPROB_JSON
ANNOTATION_TEXT = 2048
# gzip's size over the file's under ``old_rollouts: gzip`` (level 6; measured 0.061 on a Sokoban
# iteration's rollouts.jsonl, 488,669 bytes to 29,573): pages compress less well than boards
GZIP_RATIO = 0.15


@dataclass(frozen=True)
class Storage:
    """What the run's disk needs of its settings beyond the layout."""

    iterations: int = 1
    save_every: int = 1
    keep_last: int = 1  # 0: every checkpoint kept
    episodes: int = 1  # per iteration: tasks x group_size
    turns: int = 1  # per episode: the turn limit (an upper bound) or a typical count
    annotated: bool = False  # the algorithm writes annotations.jsonl each iteration
    old_rollouts: str = "keep"  # keep | gzip | delete: what becomes of a finished iteration's records


def id_bytes(shape: ModelShape) -> int:
    """A token id in JSON with its comma: the vocabulary's widest id (an upper bound)."""
    return len(str(max(shape.vocab - 1, 0))) + 1


def rollout_turn_bytes(shape: ModelShape, layout: Layout) -> float:
    prompt, reply = layout.prompt_tokens, layout.reply_tokens
    return (prompt + reply) * id_bytes(shape) + reply * (LOGPROB_JSON + REPLY_TEXT) + TURN_TEXT


def annotation_turn_bytes(layout: Layout) -> float:
    return layout.reply_tokens * ANNOTATION_PER_REPLY_TOKEN + ANNOTATION_TEXT


def saves(storage: Storage) -> int:
    """Iteration checkpoints written: every ``save_every``-th and the last."""
    return storage.iterations // storage.save_every + (1 if storage.iterations % storage.save_every else 0)


def records_kept(storage: Storage) -> tuple[float, str]:
    """How many iterations' worth of rollouts and annotations the run holds at its largest, and how said."""
    n = storage.iterations
    if storage.old_rollouts == "delete" or n == 1:
        return 1.0, "the newest iteration's"
    if storage.old_rollouts == "gzip":
        return 1 + (n - 1) * GZIP_RATIO, f"the newest iteration's, {n - 1} gzipped (x {GZIP_RATIO})"
    return float(n), f"{n} iterations'"


def run_disk(shape: ModelShape, layout: Layout, storage: Storage, checkpoint: float) -> list[Item]:
    """The run directory at its largest: the iteration checkpoints kept (one more while the
    next is written; every one with keep_last 0), the final policy, and the iterations'
    rollouts and annotations that ``old_rollouts`` keeps."""
    kept = min(storage.keep_last + 1, saves(storage)) if storage.keep_last else saves(storage)
    iterations, how = records_kept(storage)
    turns = iterations * storage.episodes * storage.turns
    items = [
        Item("checkpoints", kept * checkpoint, f"{kept} at once" + ("" if storage.keep_last else " (keep_last 0)")),
        Item("final policy", layout.module_bytes * shape.params, "RUN/checkpoint: the weights"),
        Item(
            "rollouts",
            turns * rollout_turn_bytes(shape, layout),
            f"{how}: {storage.episodes} episodes x {storage.turns} turns",
        ),
    ]
    if storage.annotated:
        items.append(Item("annotations", turns * annotation_turn_bytes(layout), f"annotations.jsonl, {how}"))
    if layout.staleness > 0:  # a resume reads versions s - k .. s of each kept checkpoint's s
        versions = (kept if storage.keep_last else saves(storage)) + layout.staleness + 1
        versions = min(versions, storage.iterations + 1)
        items.append(Item("policy versions", versions * layout.module_bytes * shape.params, f"{versions} at most"))
    return items


def estimate(shape: ModelShape, layout: Layout, storage: Storage | None = None) -> Plan:
    plan = Plan(shape, layout, phases(shape, layout))
    if layout.engine_owns_weights and not layout.colocated:
        plan.vllm = vllm_gpu(shape, layout)
    plan.disk = checkpoint_disk(shape, layout)
    if storage is not None:
        plan.run_disk = run_disk(shape, layout, storage, sum(i.bytes for i in plan.disk))
    plan.host = host_memory(shape, layout)
    plan.problems = problems(plan)
    return plan


def problems(plan: Plan) -> list[str]:
    """Why the layout cannot run, each in one line with what to change (empty: it can)."""
    shape, layout, out = plan.shape, plan.layout, []
    gb = layout.gpu_bytes / GiB
    peak = plan.peak
    states = sum(i.bytes for i in model_states(shape, layout))
    if not layout.traits.data_parallel and states > layout.gpu_bytes:  # the plainest case: say it plainly
        out.append(
            f"the torch backend holds the whole model's weights, gradients and AdamW state on one GPU: "
            f"{states / GiB:.0f} GiB of {gb:.0f} GiB; use --backend deepspeed --zero-stage 3 over several GPUs"
        )
    elif peak.bytes > layout.gpu_bytes:
        worst = max(peak.items, key=lambda i: i.bytes)
        hint = advice(plan, worst, peak)
        out.append(
            f"the {peak.name} phase needs {peak.bytes / GiB:.1f} GiB per GPU of {gb:.0f} GiB "
            f"(largest: {worst.name} {worst.bytes / GiB:.1f} GiB){hint}"
        )
    vllm = plan.vllm or ([] if not layout.colocated else vllm_gpu(shape, layout))
    if layout.engine_owns_weights and shape.heads % layout.vllm_tp:  # vLLM refuses it at start-up, a minute in
        fits = [tp for tp in (1, 2, 4, 8) if shape.heads % tp == 0]
        out.append(
            f"vLLM splits the {shape.heads} attention heads over rollout.vllm.tensor_parallel_size, which "
            f"{layout.vllm_tp} does not divide: choose one of {', '.join(map(str, fits))}"
        )
    if layout.engine_owns_weights:
        kv = next(i for i in vllm if i.name == "KV cache").bytes  # negative: not even the weights fit
        seq = (layout.prompt_tokens + layout.reply_tokens) * kv_bytes_per_token(shape) / layout.vllm_tp
        if kv < seq:
            out.append(
                f"vLLM's share ({layout.vllm_utilization:g} x {gb:.0f} GiB) leaves {kv / GiB:.1f} GiB for the KV "
                f"cache after its weights (1/{layout.vllm_tp}): not one {layout.prompt_tokens + layout.reply_tokens}"
                f"-token sequence; raise rollout.vllm.gpu_memory_utilization or tensor_parallel_size"
            )
    return out


def advice(plan: Plan, worst: Item, peak: Phase) -> str:
    """What to change, for the largest item of the phase that does not fit."""
    layout = plan.layout
    if worst.name.startswith("vLLM"):
        rest = peak.bytes - worst.bytes
        # floored: a share rounded up would leave under 10 % free
        most = math.floor(100 * (layout.gpu_bytes * (1 - HEADROOM) - rest) / layout.gpu_bytes) / 100
        if most <= 0.05:
            return f": the trainer alone needs {rest / GiB:.1f} GiB here; give vLLM GPUs of its own (rollout.gpus)"
        sleep = "" if layout.vllm_sleep or worst.name == "vLLM (colocated)" else ", turn on rollout.vllm.sleep"
        return (
            f": vLLM's share and the trainer's {rest / GiB:.1f} GiB do not fit together; set "
            f"rollout.vllm.gpu_memory_utilization at most {most:.2f} (10 % free){sleep}, or give vLLM GPUs of "
            f"its own (rollout.gpus)"
        )
    if worst.name == "activations" and not layout.gradient_checkpointing:
        return ": turn on train.gradient_checkpointing or lower train.optim.micro_batch_tokens"
    if worst.name in ("activations", "logits"):
        return ": lower train.optim.micro_batch_tokens"
    if layout.flat_partitioned:
        return ": use --zero-stage 3, more GPUs, or --offload"
    return ": use more GPUs or --offload"
