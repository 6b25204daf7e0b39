"""The memory one training rank holds, piece by piece: model states, activations, logits, KV cache.

Pure arithmetic on a model's shape (``models.shapes``) and a :class:`Layout`, for
:mod:`serl_cli.training.plan`, which adds them up into phases. Nothing here runs torch.

* **model states** -- as DeepSpeed's own estimators count them (stage_1_and_2.py:4029-4031,
  stage3.py:4046): 16-bit weights (all of them at stages 1-2, 1/N at stage 3) plus 18 bytes per
  trainable parameter over N ranks (16-bit and fp32 gradients, fp32 master weights, Adam's two
  moments); the torch backend holds fp32 weights, gradients and AdamW's moments whole (16 bytes
  per parameter) plus autocast's 16-bit weight copies. Plus the gradient bucket DeepSpeed
  allocates (``reduce_bucket_size`` elements) and, at stage 3, the gathered layers.
* **activations** of one micro-batch of ``micro_batch_tokens`` padded tokens: the tensors each
  decoder layer saves for the backward pass (counted from the Qwen2/Llama layer: RMSNorm in fp32,
  q/k/v, RoPE, SDPA with the key-value heads repeated, the SwiGLU MLP), all layers without
  gradient checkpointing, else every layer's input plus the one layer being recomputed.
* **logits**: the output head's ``[rows, reply + 1, vocabulary]`` in the compute dtype and its
  gradient (log-softmax and entropy run a slice at a time: ``training.token_logprobs``).
"""

from __future__ import annotations

from dataclasses import dataclass

from serl_cli.models.shapes import ModelShape
from serl_cli.rollout.engines import ENGINE_TRAITS, engine_traits
from serl_cli.training.train_config import BackendTraits, backend_traits

GiB = 1024**3
LOGIT_SLICE_ELEMENTS = 1 << 23  # logits training.token_logprobs works on at a time: 32 MB in fp32
SLICE_COPIES = 4  # fp32 copies of one slice of logits training.token_logprobs works on at once
ZERO3_PERSISTENCE = 100_000  # stage3_param_persistence_threshold of serl's ZeRO-3 config
ZERO3_PREFETCH = 50_000_000  # stage3_prefetch_bucket_size of serl's ZeRO-3 config
REDUCE_BUCKET = 500_000_000  # reduce_bucket_size of serl's ZeRO-2/3 configs (DeepSpeed's default too)
ZERO3_MAX_LIVE = 1_000_000_000  # DeepSpeed's default stage3_max_live_parameters (runtime/zero/config.py)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Layout:
    """What the estimate needs of a run's settings and of the machine."""

    backend: str = "torch"  # torch | deepspeed
    zero_stage: int = 0  # DeepSpeed's stage (1-3); 0 for torch
    offload: bool = False  # DeepSpeed: optimizer states (stage 3: the parameters too) in CPU memory
    ranks: int = 1  # trainer processes in all (data parallel)
    ranks_per_node: int = 1
    half: bool = True  # bf16/fp16 compute
    device: str = "cuda"  # cuda, or cpu for the CPU validation
    gradient_checkpointing: bool = False
    micro_batch_tokens: int = 16384
    reply_tokens: int = 512  # rollout.sampling.max_new_tokens
    prompt_tokens: int = 2048  # a typical prompt; decides rows per micro-batch and the KV cache
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    lora_merged: bool = True  # train.lora.save merged: checkpoints fold the adapters in
    reference: bool = False  # kl_coef > 0 without LoRA: a frozen copy of the starting policy
    teacher: bool = False  # serl, rlsd, sdpo: the hindsight teacher
    engine: str = "hf"  # hf | vllm | none (a single update on stored rollouts)
    staleness: int = 0  # max_staleness: > 0, a producer process generates beside the trainer (hf)
    rollout_rows: int = 64  # episodes generated at once (rollout.batch_size)
    vllm_gpus: int = 0  # GPUs of vLLM's own (rollout.gpus); 0 with vllm: colocated with the trainer
    vllm_tp: int = 1
    vllm_utilization: float = 0.5
    vllm_sleep: bool = False
    vllm_data_parallel: bool = False  # one engine per vllm_tp trainer GPUs (colocated)
    gpu_bytes: float = 80 * GiB
    reduce_bucket: int = REDUCE_BUCKET
    comm_bytes: int = 0  # DeepSpeed's communication_data_type in bytes (serl's configs: fp32); 0: the module's
    max_live_params: int = ZERO3_MAX_LIVE  # stage3_max_live_parameters: what ZeRO-3 may hold gathered at once

    @property
    def traits(self) -> BackendTraits:
        return backend_traits(self.backend)

    @property
    def sharded(self) -> bool:
        """ZeRO-3: every weight partitioned over the ranks."""
        return self.traits.zero and self.zero_stage == 3

    @property
    def flat_partitioned(self) -> bool:
        """ZeRO-1/2: the weights whole on every rank, flattened into a copy, the optimizer partitioned."""
        return self.traits.zero and self.zero_stage < 3

    @property
    def module_bytes(self) -> int:
        """Bytes per weight of the module that runs forward: DeepSpeed holds it in 16 bits
        under bf16/fp16, the torch backend keeps fp32 master weights (autocast casts copies)."""
        return 2 if self.half and self.traits.half_module else 4

    @property
    def compute_bytes(self) -> int:
        return 2 if self.half else 4

    @property
    def generates(self) -> bool:
        """An online run generates (a single update on stored rollouts does not: engine "none")."""
        return self.engine in ENGINE_TRAITS

    @property
    def engine_owns_weights(self) -> bool:
        """The engine holds its own copy of the policy (vLLM), in its own memory."""
        return self.generates and engine_traits(self.engine).own_weights

    @property
    def colocated(self) -> bool:
        return self.engine_owns_weights and self.vllm_gpus == 0


@dataclass
class Item:
    name: str
    bytes: float
    note: str = ""


def trainable_params(shape: ModelShape, layout: Layout) -> int:
    """Every parameter, or under LoRA the adapters' (A: in x r, B: r x out, per targeted linear)."""
    if layout.lora_rank <= 0:
        return shape.params
    q, kv, h, i = shape.heads * shape.dim, shape.kv_width, shape.hidden, shape.intermediate
    sizes = {
        "q_proj": h + q,
        "k_proj": h + kv,
        "v_proj": h + kv,
        "o_proj": q + h,
        "gate_proj": h + i,
        "up_proj": h + i,
        "down_proj": i + h,
    }
    return shape.layers * layout.lora_rank * sum(sizes[t] for t in layout.lora_targets if t in sizes)


def persistent_params(shape: ModelShape) -> int:
    """Parameters ZeRO-3 keeps whole on every rank: tensors under its persistence threshold."""
    q, kv, h, i = shape.heads * shape.dim, shape.kv_width, shape.hidden, shape.intermediate
    tensors = [h * q, h * kv, h * kv, q * h, h * i, h * i, i * h, h, h]
    if shape.qkv_bias:
        tensors += [q, kv, kv]
    return shape.layers * sum(t for t in tensors if t < ZERO3_PERSISTENCE) + shape.hidden


def model_states(shape: ModelShape, layout: Layout) -> list[Item]:
    """Weights, gradients and optimizer state held by one rank for the whole run."""
    p, pt, n, w = shape.params, trainable_params(shape, layout), layout.ranks, layout.module_bytes
    if not layout.traits.zero:
        items = [
            Item("weights", 4 * p, "fp32 master weights"),
            Item("gradients", 4 * pt, "fp32"),
            Item("optimizer", 8 * pt, "AdamW's two fp32 moments"),
        ]
        if layout.half:
            items.append(
                Item("autocast weight copies", 2 * (p - shape.embedding_params), "16-bit casts, kept for backward")
            )
        return items
    stage = layout.zero_stage
    offload = layout.offload and layout.device == "cuda"
    if stage == 3:
        shard = (p - persistent_params(shape)) / n + persistent_params(shape)
        weights = Item("weights", 0 if offload else w * shard, f"1/{n} of the 16-bit weights" if w == 2 else f"1/{n}")
    else:
        weights = Item("weights", w * p, "16-bit module" if w == 2 else "the module, flattened")
    if stage == 1:  # the module's whole .grad, and this rank's fp32 partition of it
        grads, note = w * pt + 4 * pt / n, "whole 16-bit + the fp32 partition"
    elif stage == 2:
        grads, note = w * pt / n + (4 * pt / n if w == 2 else 0), f"1/{n}: 16-bit + fp32"
    else:  # reduce-scattered from the bucket straight into an fp32 partition
        grads, note = 4 * pt / n, f"1/{n}, fp32"
    if offload:  # the fp32 gradients live with the optimizer, in CPU memory
        grads, note = (w * pt, w * pt / n, 0.0)[stage - 1], "16-bit; fp32 in CPU memory"
    items = [
        weights,
        Item("gradients", grads, note),
        Item("optimizer", 0 if offload else 12 * pt / n, "in CPU memory" if offload else f"1/{n}: fp32 master + Adam"),
    ]
    # stages 2-3 allocate the bucket in the communication dtype (DeepSpeed 0.19.8 stage3.py:782, the
    # ipg_buckets keyed by communication_data_type), fp32 in serl's configs
    bucket_bytes = 4 if stage == 1 else (layout.comm_bytes or w)
    bucket = layout.reduce_bucket if layout.device == "cuda" else min(layout.reduce_bucket, pt)
    items.append(Item("gradient bucket", bucket * bucket_bytes, f"reduce_bucket_size x {bucket_bytes} bytes"))
    if stage == 3:
        items.append(Item("gathered layers", w * zero3_live_params(shape, layout), "up to stage3_max_live_parameters"))
    return items


def zero3_live_params(shape: ModelShape, layout: Layout) -> int:
    """Parameters ZeRO-3 may hold gathered at once: its live-parameter limit (at least the largest
    tensor and the prefetch bucket), no more than the partitioned model."""
    floor = shape.largest_tensor + ZERO3_PREFETCH
    return min(max(layout.max_live_params, floor), shape.params - persistent_params(shape))


def layer_activation_bytes(shape: ModelShape, layout: Layout) -> float:
    """Bytes one decoder layer saves for backward, per token: two RMSNorms (their fp32 input
    and normalized output), q/k/v, RoPE's inputs and rotations, SDPA's inputs (the key-value heads
    repeated) and output, o_proj's input, and the MLP's gate, up, activation and product."""
    c = layout.compute_bytes
    q, kv, h, i = shape.heads * shape.dim, shape.kv_width, shape.hidden, shape.intermediate
    norms = 2 * (4 + c) * h
    attention = c * (7 * q + 2 * kv)
    mlp = c * 4 * i
    return norms + attention + mlp


def activation_bytes(shape: ModelShape, layout: Layout, checkpointing: bool) -> float:
    """Saved activations of one micro-batch at their largest: every layer's, or with gradient
    checkpointing every layer's input plus the one layer being recomputed. (The backward pass
    frees a layer's saved tensors as it allocates their gradients: measured, it adds ~5 %.)"""
    t = layout.micro_batch_tokens
    layer = layer_activation_bytes(shape, layout) * t
    if not checkpointing:
        return shape.layers * layer
    residual = 2 if layout.module_bytes == 2 else 4
    return shape.layers * residual * shape.hidden * t + layer


def logit_positions(layout: Layout) -> int:
    """Positions the output head scores in one micro-batch: each row's reply and one more."""
    row = layout.prompt_tokens + layout.reply_tokens
    rows = max(1, layout.micro_batch_tokens // max(row, 1))
    return min(layout.micro_batch_tokens, rows * (layout.reply_tokens + 1))


def logit_bytes(shape: ModelShape, layout: Layout, backward: bool) -> float:
    """The head's logits in the compute dtype (and their gradient, for an update), plus the fp32
    work of one slice of positions (``training.token_logprobs``)."""
    positions = logit_positions(layout)
    one = positions * shape.vocab * layout.compute_bytes
    slice_positions = min(positions, max(1, LOGIT_SLICE_ELEMENTS // shape.vocab))
    return (2 if backward else 1) * one + SLICE_COPIES * 4 * slice_positions * shape.vocab


def forward_bytes(shape: ModelShape, layout: Layout) -> float:
    """A forward pass without gradients (pi_old, the teacher): one layer's transients at a time."""
    c, t = layout.compute_bytes, layout.micro_batch_tokens
    return c * t * (3 * shape.intermediate + 4 * shape.hidden) + logit_bytes(shape, layout, backward=False)


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2) -> int:
    return shape.layers * 2 * shape.kv_width * dtype_bytes
