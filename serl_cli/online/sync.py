"""What leaves the trainer after an online iteration's update: the checkpoint (policy,
resume state, teacher snapshot) and the new weights of an engine that holds its own copy
(vLLM). Apart from the loop (:mod:`serl_cli.online.loop`), whose docstring gives the rules.
"""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serl_cli.models.device import release_memory
from serl_cli.rollout.engines import refresh_weights, sleep_engine

if TYPE_CHECKING:
    from serl_cli.method.teacher import TeacherSnapshot
    from serl_cli.online.ranks import PhaseLog
    from serl_cli.rollout.engines.vllm import VLLMConfig
    from serl_cli.rollout.prompts import PromptConfig
    from serl_cli.training.learner import Learner


def disk_bytes(path: Path) -> int:
    """The bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


class PolicyOut:
    """The learner's policy out to disk and to the engine (every process calls each method)."""

    # engine: the rollout engine (None: a vLLM rank that runs none); Any, as the weight stream goes
    # to vLLM's own update_weights, which the Engine protocol does not declare
    def __init__(self, learner: Learner, teacher: TeacherSnapshot | None, engine: Any, vllm: VLLMConfig | None = None):
        self.learner, self.teacher, self.engine, self.vllm = learner, teacher, engine, vllm
        self.sized = False  # the first checkpoint's size is printed

    def save(self, checkpoint: Path, prompt: PromptConfig) -> int:
        """An iteration's checkpoint: the policy, its resume state, and the teacher snapshot
        (so a resumed run matches); returns its size in bytes. An engine that holds its own copy
        sleeps first (colocated: a save gathers the whole model, and an awake engine's memory
        with it would not fit)."""
        sleep_engine(self.engine)
        teacher = self.teacher
        self.learner.save(checkpoint, prompt=prompt, extra=teacher.save if teacher is not None else None)
        size = disk_bytes(checkpoint)
        if self.learner.is_main and not self.sized:
            self.sized = True
            print(f"serl: a checkpoint of this run takes {size / 2**20:.1f} MiB ({checkpoint})", file=sys.stderr)
        return size

    def save_final(self, path: Path, prompt: PromptConfig) -> None:
        """The run's final policy, the engine asleep as for every save (the last weight sync woke it)."""
        sleep_engine(self.engine)
        self.learner.save(path, prompt=prompt)

    def sync_engine(self, it: Path, saved: bool, log: PhaseLog) -> dict:
        """After an update, an engine with its own weights (vLLM) serves the new policy: streamed
        in memory (``vllm.weight_sync: memory``; under ZeRO-3 one weight gathered at a time, so
        every process takes part) or reloaded from disk (``disk``: the checkpoint just saved, or
        else the weights alone, written for it and removed once read). Every process that runs
        an engine (``vllm.data_parallel``: one per tensor-parallel group) updates its own."""
        if self.vllm is None:
            return {}
        t0 = time.perf_counter()
        learner, main, out = self.learner, self.learner.is_main, {}
        if self.vllm.sleep:  # colocated: every process gives back what its allocator caches first
            release_memory()
            learner.barrier()
        if self.vllm.weight_sync == "disk":
            source = it / "checkpoint"
            if not saved:  # no checkpoint due: what vLLM reads and nothing else
                source = learner.save(it / "weights", weights_only=True)
                out["sync_weights_bytes"] = disk_bytes(source)
            if self.engine is not None:  # every process that runs an engine (rank 0's, or data parallel)
                refresh_weights(self.engine, source)
            learner.barrier()
            if main and not saved:
                shutil.rmtree(source)
        else:
            stream = learner.stream_weights()
            if self.engine is not None:  # each engine takes the whole stream into its own copy
                out.update(self.engine.update_weights(stream, largest=learner.largest_weight()))
            else:
                for _ in stream:  # its part of each weight's gather
                    pass
        log.phase("sync", time.perf_counter() - t0)
        return out
