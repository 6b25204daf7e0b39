"""What an update reports: its progress in micro-batches, and its metrics (the optimizer
steps' means, the batch's episodes). Apart from :mod:`serl_cli.training.learner`, which runs
the update."""

from __future__ import annotations

from collections.abc import Callable

from serl_cli.artifacts.records import Episode


class Ticker:
    """An update's progress in micro-batches for ``progress(done, total)``: one per forward pass,
    and at each optimizer step's end all of the step's (a step that stopped early on a non-finite
    loss, or a DeepSpeed process that ran only its share of the micro-batches, catches up there)."""

    def __init__(self, progress: Callable[[int, int], object] | None, total: int):
        self.progress, self.total, self.done, self.base = progress, total, 0, 0
        if progress is not None:
            progress(0, total)

    def one(self) -> None:
        if self.progress is not None and self.done < self.total:
            self.done += 1
            self.progress(self.done, self.total)

    def step(self, micro_batches: int) -> None:
        self.base += micro_batches
        if self.progress is not None and self.done < self.base:
            self.done = self.base
            self.progress(self.done, self.total)


def mean_step_stats(steps: list[dict]) -> dict:
    if not steps:  # no turn had a gradient (every group's rewards were equal): nothing was applied
        return {"loss": 0.0, "skipped_steps": 0, "optimizer_steps": 0}
    # a skipped step (non-finite loss or gradient) applied nothing: the means are over the applied ones
    applied = [s for s in steps if not s.get("skipped")]
    keys = sorted({k for s in applied for k in s})
    out = {k: sum(s.get(k, 0.0) for s in applied) / len(applied) for k in keys if k != "skipped"}
    if not applied:
        out["loss"] = float("nan")  # every step was skipped: there is no applied loss to report
    out["skipped_steps"] = len(steps) - len(applied)
    out["optimizer_steps"] = len(steps)
    return out


def episode_stats(episodes: list[Episode]) -> dict:
    n = len(episodes)
    faulted = [e for e in episodes if e.error]  # crashed, timed out, or failed at reset
    return {
        "mean_reward": sum(e.reward for e in episodes) / n,
        "success_rate": sum(e.success for e in episodes) / n,
        "episodes": n,
        "faulted_episodes": len(faulted),
        "faulted_turns": sum(len(e.turns) for e in faulted),
    }
