"""How an online iteration's work is divided over the processes of a launched job, and what
each process says of its share (the design: :mod:`serl_cli.online.loop`'s docstring).

An iteration's rollouts are made by R generators (:class:`Generators`): with the hf engine every
process (R = W, group g is process ``g % W``'s); with vLLM one engine (R = 1, rank 0's) or,
with ``rollout.vllm.data_parallel``, one engine per ``tensor_parallel_size`` processes (R = W /
TP, group g is engine ``g % R``'s, on rank ``(g % R) * TP``). The periodic evaluation's i-th
panel task is generator ``i % R``'s. Whole groups, so a group's advantages never need another
process. (The π_old recompute and the teacher's scoring are dealt by micro-batch instead:
:mod:`serl_cli.training.scoring`.) Each process logs one line per phase on stderr (``rank
1/2: rollout 2 group(s) ...``) when there are several, so a long phase never looks like a
hang, and its seconds go to ``timings.jsonl``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from serl_cli.artifacts.records import Episode
from serl_cli.errors import SerlError
from serl_cli.rollout.runner import EpisodeSpec
from serl_cli.training.scoring import own_items

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from serl_cli.training.scoring import ScoreItem


def world_size() -> int:
    """The number of processes the launcher started (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@dataclass(frozen=True)
class Generators:
    """Which processes generate, and whose task groups each one serves: ``replicas`` engines,
    engine j on rank ``j * stride``. The hf engine: every process (stride 1). vLLM: rank 0's
    one engine, or with ``data_parallel`` one per ``tp`` processes, on their GPUs."""

    replicas: int
    stride: int

    @classmethod
    def of(
        cls, engine: str, world: int, data_parallel: bool = False, tp: int = 1, local: int | None = None
    ) -> Generators:
        """For ``world`` processes, ``local`` of them on each node (an engine's GPUs are on one node)."""
        if engine != "vllm":
            return cls(world, 1)
        if not data_parallel:
            return cls(1, max(world, 1))
        if world % tp or (local or world) % tp:
            raise SerlError(
                f"rollout.vllm.data_parallel: {local or world} processes per node do not divide into engines of "
                f"tensor_parallel_size {tp}; start a multiple of {tp} per node"
            )
        return cls(world // tp, tp)

    def replica(self, rank: int) -> int | None:
        """The engine ``rank`` runs (None: it runs none and waits for the others)."""
        j, r = divmod(rank, self.stride)
        return j if r == 0 and j < self.replicas else None

    def server(self, group_id: int) -> int:
        """The rank whose engine generates task group ``group_id`` (panel task i: the same for i)."""
        return (group_id % self.replicas) * self.stride

    def share(self, specs: list[EpisodeSpec], rank: int, by_group: bool = True) -> list:
        """``rank``'s share of ``specs``: its engine's task groups, or every R-th of a list (the panel)."""
        j = self.replica(rank)
        if j is None:
            return []
        return own_specs(specs, j, self.replicas) if by_group else specs[j :: self.replicas]


def check_shares(engine: str, sampled: bool, coupled: bool, world: int, replicas: int | None = None) -> None:
    """Where several engines sample (the hf engine under several processes, or vLLM's
    data-parallel engines) each samples its own groups: a row's draws must not depend on which
    engine or batch it ran in, or the run would change with the number of processes. Coupled
    sampling keys each row's draws by the run's seed, the row and the turn
    (``rollout.sampling.coupled``), so it is required, not switched on behind the config's
    back: the same config then gives the same rollouts on 1 or N processes (with vLLM, up to
    its kernels' batch-dependent rounding). vLLM's one engine needs nothing: it serves every group."""
    engines = replicas if replicas is not None else (world if engine == "hf" else 1)
    if engines > 1 and sampled and not coupled:
        if engine == "hf":
            why = f"{world} processes with --engine hf sample their own task groups"
            other = ", or use --engine vllm"
        else:
            why = f"rollout.vllm.data_parallel: {engines} vLLM engines sample their own task groups"
            other = ", or set rollout.vllm.data_parallel=false"
        raise SerlError(
            f"{why}: set rollout.sampling.coupled=true so a row's draws do not depend on the process it runs in "
            f"(the run then equals a one-process run with the same settings){other}"
        )


def own_specs(specs: list[EpisodeSpec], rank: int, world: int) -> list[EpisodeSpec]:
    """The episodes of this process's task groups (whole groups: group g is process g % W's)."""
    return [s for s in specs if s.group_id % world == rank]


def as_stored(records: list[Episode]) -> list[Episode]:
    """Records as ``rollouts.jsonl`` holds them (a JSON round trip), so every process reads
    exactly what the main one writes."""
    return [
        Episode.from_dict(json.loads(json.dumps(r.to_dict(), separators=(",", ":"))), need_tokens=False)
        for r in records
    ]


def in_spec_order(specs: list[EpisodeSpec], parts: list[list[Episode]]) -> list[Episode]:
    """Every process's records of ``specs``, merged in the order of ``specs`` -- the order one
    process running them all writes them in."""
    found = {(r.group_id, r.rollout_index): r for part in parts for r in part}
    return [found[(s.group_id, s.rollout_index)] for s in specs]


class CountingScorer:
    """A scorer (``training.scoring.score``'s signature) that counts how many of the items it
    was given (the turns the teacher weighs, and the teacher signal's probes) are this
    process's own share, and the seconds it took."""

    def __init__(self, scorer: Callable[..., list[list[float]]], rank: int, world: int):
        self.scorer, self.rank, self.world = scorer, rank, world
        self.own = self.total = 0
        self.seconds = 0.0

    # model: the policy or teacher as scoring runs it (a Hugging Face model, its peft wrapper): Any
    def __call__(
        self,
        model: Any,
        tokenizer: PreTrainedTokenizerBase,
        items: list[ScoreItem],
        temperature: float,
        micro_batch_tokens: int,
    ) -> list[list[float]]:
        t0 = time.perf_counter()
        out = self.scorer(model, tokenizer, items, temperature, micro_batch_tokens)
        self.seconds += time.perf_counter() - t0
        self.total += len(items)
        self.own += own_items(model, items, micro_batch_tokens, self.rank, self.world)
        return out


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak memory: allocated on its GPU since the iteration began, or its
    resident set's high-water mark on a CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class PhaseLog:
    """One process's phases of one iteration: seconds and counts for ``timings.jsonl``, and
    under several processes one stderr line each."""

    def __init__(self, rank: int, world: int, device: torch.device):
        self.rank, self.world, self.device = rank, world, device
        self.record: dict = {"rank": rank}
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def phase(self, name: str, seconds: float, text: str = "", **counts: int) -> None:
        self.record[f"{name}_s"] = round(seconds, 3)
        self.record.update({f"{name}_{k}": v for k, v in counts.items()})
        if self.world > 1:
            print(
                f"serl: rank {self.rank}/{self.world}: {name} {text + ', ' if text else ''}{seconds:.1f} s",
                file=sys.stderr,
                flush=True,
            )

    def finish(self) -> dict:
        self.record["peak_memory_bytes"] = peak_memory_bytes(self.device)
        return self.record
