"""How long one iteration of a vLLM run takes, phase by phase: an estimate from stated assumptions.

``serl plan`` prints it for each layout of a vLLM run. Nothing here is measured: every figure is
arithmetic on the model's size, the iteration's tokens and the constants below, each with its
source, and none of it has run on a GPU. Per iteration, in seconds:

* **generation**, a range. Throughput-bound: every prompt and reply token at 2 FLOPs per parameter,
  over the generating GPUs at :data:`PREFILL_MFU`. Decode-bound: the prompts prefilled so, then
  one decode step per reply token of the longest episode (its turns x ``max_new_tokens``), each
  step reading the engine's weights and its rows' KV cache from HBM at peak bandwidth; the engines
  decode side by side, each with its share of the episodes.
* **pi_old**: the forward that recomputes the rollout policy's log-probs, 2 FLOPs per parameter
  and token.
* **teacher** (SERL, RLSD, SDPO): a forward over :data:`TEACHER_TOKEN_RATIO` times the update's
  tokens.
* **update**: forward and backward, 6 FLOPs per parameter and token, plus gradient checkpointing's
  second forward (2 more). These three on the training GPUs at :data:`TRAIN_MFU`.
* **weight sync** into the engines and, colocated, the engines' **sleep and wake**: constants.

pi_old, the teacher and the update read every turn's prompt and reply (the paper configs'
entropy bonus gives every turn a gradient). A layout whose generation and training take turns
(colocated, or split at ``max_staleness: 0``) adds every phase; the split layout with the vLLM
producer at ``max_staleness`` >= 1 takes, once steady, the longer of its two sides -- the producer's
generation and the trainer's pi_old, teacher and update -- plus the weight sync, the hand-over
both sides wait for (the trainer publishes a version, the producer pushes it into its engine).

Left out: the environments' steps (``rollout.env_workers`` shares them out), evaluations,
checkpoint writes, vLLM's scheduling and sampling, prefix-cache hits (every prompt is prefilled
whole) and replies shorter than ``max_new_tokens`` (every reply is counted at it).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from serl_cli.models.shapes import ModelShape
from serl_cli.training.memory import kv_bytes_per_token

# NVIDIA's H100 SXM5 datasheet: 989 TFLOP/s dense bf16 (its 1,979 "with sparsity", halved), 3.35 TB/s HBM3
H100_SXM_BF16_FLOPS = 989e12
H100_SXM_HBM_BYTES_PER_S = 3.35e12
# assumed: the update's share of that peak (ZeRO-3's gathers inside it), the GPU check's target (docs/SCALING.md)
TRAIN_MFU = 0.4
PREFILL_MFU = 0.6  # assumed: vLLM's prefill of long prompts, large matrix products
# measured on a CPU (Sokoban, docs/SCALING.md "SERL's price"): SERL's teacher read 2.11-2.13x the tokens the
# update trained on, forward only. There the block doubles a 67-token prompt; on long prompts (ALFWorld's,
# WebShop's: not measured) a short block adds less, so this is an upper bound there
TEACHER_TOKEN_RATIO = 2.1
WEIGHT_SYNC_S = 15.0  # assumed: one sync through host memory, the middle of docs/SCALING.md's 10-20 s (not measured)
SLEEP_WAKE_S = 5.0  # assumed: a colocated engine freeing and re-allocating its weights and KV cache (not measured)


@dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # dense bf16 FLOP/s of one GPU
    hbm_bytes_per_s: float  # one GPU's memory bandwidth
    train_mfu: float = TRAIN_MFU
    prefill_mfu: float = PREFILL_MFU


H100_SXM = Hardware("H100 SXM", H100_SXM_BF16_FLOPS, H100_SXM_HBM_BYTES_PER_S)


@dataclass(frozen=True)
class Batch:
    """An iteration's rollouts."""

    episodes: int  # tasks x group size
    turns: int  # a typical episode's turns: the tokens every phase reads
    longest_turns: int  # the longest episode's turns: the decode steps (the turn limit)
    prompt_tokens: int
    reply_tokens: int  # max_new_tokens: every reply counted at the cap

    @property
    def prompt_total(self) -> int:
        return self.episodes * self.turns * self.prompt_tokens

    @property
    def tokens(self) -> int:
        return self.episodes * self.turns * (self.prompt_tokens + self.reply_tokens)


@dataclass(frozen=True)
class Placement:
    """Where an iteration's phases run."""

    name: str
    generating_gpus: int
    tensor_parallel: int  # GPUs per engine
    training_gpus: int
    sleeps: bool = False  # colocated: each engine sleeps and wakes every iteration
    staleness: int = 0  # >= 1: the vLLM producer generates beside the update (its own GPUs)

    @property
    def engines(self) -> int:
        return max(1, self.generating_gpus // self.tensor_parallel)


@dataclass(frozen=True)
class IterationTime:
    """Seconds per phase of one iteration; the generation and the iteration as (throughput-bound,
    decode-bound)."""

    layout: str
    generation: tuple[float, float]
    pi_old: float
    teacher: float
    update: float
    sync: float
    sleep_wake: float
    overlapped: bool  # the producer generates beside the trainer

    @property
    def trainer(self) -> float:
        return self.pi_old + self.teacher + self.update

    @property
    def iteration(self) -> tuple[float, float]:
        def at(generation: float) -> float:
            return iteration_seconds(generation, self.trainer, self.sync, self.sleep_wake, self.overlapped)

        return at(self.generation[0]), at(self.generation[1])

    @property
    def over_grpo(self) -> tuple[float, float]:
        """This iteration against the same layout's without the teacher phase (GRPO's)."""
        grpo = replace(self, teacher=0.0).iteration
        lo, hi = (mine / theirs for mine, theirs in zip(self.iteration, grpo, strict=True))
        return lo, hi


# -- the arithmetic -------------------------------------------------------------------------------
def forward_flops(params: float, tokens: float) -> float:
    """A forward pass: a multiply and an add per parameter and token."""
    return 2 * params * tokens


def update_flops(params: float, tokens: float, checkpointing: bool) -> float:
    """Forward (2) and backward (4) per parameter and token; checkpointing recomputes the forward."""
    return (8 if checkpointing else 6) * params * tokens


def compute_seconds(flops: float, gpus: int, peak_flops: float, mfu: float) -> float:
    return flops / (gpus * peak_flops * mfu)


def decode_step_bytes(weight_bytes: float, rows: int, context_tokens: float, kv_per_token: float) -> float:
    """What one decode step of an engine reads from HBM: every weight, and each row's KV cache."""
    return weight_bytes + rows * context_tokens * kv_per_token


def memory_seconds(read_bytes: float, gpus: int, bandwidth: float) -> float:
    """Reading ``read_bytes`` split over ``gpus`` GPUs (tensor parallelism) at peak bandwidth."""
    return read_bytes / (gpus * bandwidth)


def iteration_seconds(generation: float, trainer: float, sync: float, sleep_wake: float, overlapped: bool) -> float:
    """Taking turns, everything adds up; overlapped (the producer at k >= 1), the longer side once
    steady, and the weights handed over between them."""
    if overlapped:
        return max(generation, trainer) + sync
    return generation + sleep_wake + trainer + sync


def generation_seconds(shape: ModelShape, batch: Batch, where: Placement, hw: Hardware) -> tuple[float, float]:
    """(throughput-bound, decode-bound): the second never below the first."""

    def prefill(tokens: float) -> float:
        return compute_seconds(forward_flops(shape.params, tokens), where.generating_gpus, hw.flops, hw.prefill_mfu)

    throughput = prefill(batch.tokens)
    rows = -(-batch.episodes // where.engines)  # each engine's share, the largest
    context = batch.prompt_tokens + batch.reply_tokens / 2  # a row's KV cache, on average over its reply
    step = decode_step_bytes(2 * shape.params, rows, context, kv_bytes_per_token(shape))
    decode = batch.longest_turns * batch.reply_tokens * memory_seconds(step, where.tensor_parallel, hw.hbm_bytes_per_s)
    return throughput, max(throughput, prefill(batch.prompt_total) + decode)


def estimate_iteration(
    shape: ModelShape, batch: Batch, where: Placement, hw: Hardware = H100_SXM, *, teacher: bool, checkpointing: bool
) -> IterationTime:
    train = where.training_gpus
    p, tokens, peak, mfu = shape.params, batch.tokens, hw.flops, hw.train_mfu
    return IterationTime(
        layout=where.name,
        generation=generation_seconds(shape, batch, where, hw),
        pi_old=compute_seconds(forward_flops(p, tokens), train, peak, mfu),
        teacher=compute_seconds(forward_flops(p, TEACHER_TOKEN_RATIO * tokens), train, peak, mfu) if teacher else 0.0,
        update=compute_seconds(update_flops(p, tokens, checkpointing), train, peak, mfu),
        sync=WEIGHT_SYNC_S,
        sleep_wake=SLEEP_WAKE_S if where.sleeps else 0.0,
        overlapped=where.staleness >= 1,
    )


# -- over a run -----------------------------------------------------------------------------------
def teacher_iterations(iterations: int, mixing_lambda: float, decay_steps: int, skip_zero_advantage: bool) -> int:
    """Iterations whose update the teacher scores for: while lambda > 0, as ``method.annotation.
    teacher_wanted`` decides (lambda decays to 0 over ``decay_steps`` updates, then the teacher is
    dropped), every one where its log-probs are wanted for themselves."""
    if not skip_zero_advantage:
        return iterations
    if mixing_lambda <= 0:
        return 0
    return iterations if decay_steps <= 0 else min(iterations, decay_steps)


def run_ratio(over_grpo: float, with_teacher: int, iterations: int) -> float:
    """A whole run against GRPO's: ``with_teacher`` iterations at ``over_grpo``, the rest at 1."""
    return (with_teacher * over_grpo + iterations - with_teacher) / iterations if iterations else 1.0
