"""How an online iteration's work is divided over the processes of a launched job, and what
each process says of its share (the design: :mod:`serl_cli.online.loop`'s docstring).

Task group g belongs to process ``g % W`` for the whole iteration -- its rollouts, their
π_old recompute, their teacher scoring -- and the periodic evaluation's i-th panel task to
``i % W``. Whole groups, so a group's advantages never need another process. Each process
logs one line per phase on stderr (``rank 1/2: rollout 2 group(s) ...``) when there are
several, so a long phase never looks like a hang, and its seconds go to ``timings.jsonl``.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time

import torch

from serl_cli.artifacts.records import Episode
from serl_cli.errors import SerlError
from serl_cli.rollout.runner import EpisodeSpec
from serl_cli.training.scoring import own_items


def world_size() -> int:
    """The number of processes the launcher started (1 without one)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_shares(engine: str, sampled: bool, coupled: bool, world: int) -> None:
    """Under several processes with the hf engine each process samples its own groups: a
    row's draws must not depend on which process or batch it ran in, or the run would change
    with the number of processes. Coupled sampling keys each row's draws by the run's seed,
    the row and the turn (``rollout.sampling.coupled``), so it is required, not switched on
    behind the config's back: the same config then gives the same rollouts on 1 or N
    processes. (vLLM needs nothing: rank 0's engine serves every group.)"""
    if world > 1 and engine == "hf" and sampled and not coupled:
        raise SerlError(
            f"{world} processes with --engine hf sample their own task groups: set rollout.sampling.coupled=true "
            f"so a row's draws do not depend on the process it runs in (the run then equals a one-process run "
            f"with the same settings), or use --engine vllm"
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

    def __init__(self, scorer, rank: int, world: int):
        self.scorer, self.rank, self.world = scorer, rank, world
        self.own = self.total = 0
        self.seconds = 0.0

    def __call__(self, model, tokenizer, items, temperature, micro_batch_tokens):
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

    def phase(self, name: str, seconds: float, text: str = "", **counts) -> None:
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
