"""Experiment tracking: every metric of ``metrics.jsonl`` also to TensorBoard and/or Weights & Biases.

``metrics.jsonl`` stays the record serl itself reads; a tracker is a copy for the tools people
watch runs in. TensorBoard event files go to ``RUN/tensorboard/``; W&B runs honour its own
environment (``WANDB_MODE=offline``, ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_DIR``). Both are
optional extras (``serl[tensorboard]``, ``serl[wandb]``). The resolved configuration is logged as
the run's hyperparameters (W&B config; a TensorBoard text entry), under the run's name.
"""

from __future__ import annotations

import json
from pathlib import Path

from serl_cli.errors import SerlError

BACKENDS = ("none", "tensorboard", "wandb")


def check_backends(names: list[str] | None) -> list[str]:
    """The trackers asked for (``none`` alone means none), checked before any work starts."""
    names = [n.strip() for n in (names or []) if n.strip()]
    for n in names:
        if n not in BACKENDS:
            raise SerlError(f"unknown --report-to {n!r}: choose from {', '.join(BACKENDS)} (repeatable)")
    if "none" in names and len(names) > 1:
        raise SerlError("--report-to none cannot be combined with a tracker")
    names = [n for n in names if n != "none"]
    for n in names:
        _import(n)  # a missing extra fails now, not after the first iteration
    return names


def _import(name: str):
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            return SummaryWriter
        import wandb

        return wandb
    except ImportError:
        raise SerlError(f"--report-to {name} needs the {name} package: pip install 'serl[{name}]'") from None


def scalars(metrics: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of ``metrics`` with ``/``-joined names (nested sections such as ``timing``)."""
    out = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(scalars(value, f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


class Tracker:
    """Send each update's metrics to the chosen trackers; a no-op with none."""

    def __init__(self, backends: list[str], run_dir: str | Path, run_name: str, config: dict):
        # opened at the first log, when the stage has made (or checked) the run directory
        self.backends, self.run_dir, self.run_name, self.config = backends, Path(run_dir), run_name, config
        self.writers: list = []

    def _open(self) -> None:
        if "tensorboard" in self.backends:
            writer = _import("tensorboard")(log_dir=str(self.run_dir / "tensorboard"))
            writer.add_text("config", "```\n" + json.dumps(self.config, indent=2, default=str) + "\n```")
            self.writers.append(("tensorboard", writer))
        if "wandb" in self.backends:
            wandb = _import("wandb")
            self.writers.append(
                ("wandb", wandb.init(name=self.run_name, config=self.config, dir=str(self.run_dir), reinit=True))
            )

    def log(self, metrics: dict, step: int) -> None:
        if self.backends and not self.writers:
            self._open()
        values = scalars(metrics)
        for kind, writer in self.writers:
            if kind == "tensorboard":
                for name, value in values.items():
                    writer.add_scalar(name, value, global_step=step)
                writer.flush()
            else:
                writer.log(values, step=step)

    def close(self) -> None:
        for kind, writer in self.writers:
            writer.close() if kind == "tensorboard" else writer.finish()
        self.writers = []
