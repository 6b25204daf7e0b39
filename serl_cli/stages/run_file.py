"""The run file (``RUN/online.yaml``, ``experiments/*/*.yaml``): the online loop's configuration
with each setting once, and what ``serl rollout``, ``serl eval`` and ``serl annotate`` read of it
when given one as ``--config``. The loop itself is :mod:`serl_cli.stages.online`."""

from __future__ import annotations

import dataclasses

from serl_cli import config as cfgmod
from serl_cli.artifacts import io
from serl_cli.errors import SerlError

# -- the run file: each setting once, and what each stage's command reads of it ---------------------
# The per-stage copies of the run's own settings that the loop sets itself: the rollouts' environment,
# policy, seed (seed * 1000 + k) and directory (iter_k); the update's starting policy, seed (the run's)
# and checkpoint (iter_k/checkpoint, RUN/checkpoint); the annotation's seed and update counter. The
# resolved online.yaml leaves them out, so each setting appears once; a file that sets them (an older
# online.yaml) still loads, and they are ignored, as they always were.
LOOP_SETS = {
    "rollout": ("env", "model", "seed", "out"),
    "train": ("model", "seed", "checkpoint"),
    "annotate": ("seed", "update_step"),
}


def run_settings(cfg) -> dict:
    """The run's configuration as written to ``RUN/online.yaml`` and the manifest: every setting
    once, without the per-stage copies the loop sets (:data:`LOOP_SETS`). Loaded again it gives
    the same run (``from_dict(OnlineConfig, run_settings(cfg))``)."""
    plain = io.to_plain(cfg)
    for section, keys in LOOP_SETS.items():
        for key in keys:
            plain[section].pop(key)
    return plain


# What `serl rollout`, `serl eval` and `serl annotate` read of a run file (the online loop's layout):
# (key in the run file, key of the command's own settings[, a value that means "not set"]). Each reads
# it as the loop's step does: rollouts as an iteration collects them (its `rollout` section, the run's
# env, model and seed), an evaluation as the periodic one runs (the `eval` section; the environment's
# evaluation split unless eval.split; the rollouts' engine, batch, token budget and prompt history).
# A section "S.*" is all of S but the keys the loop sets. Keys of the file not read are named in a note.
RUN_FILE_READS = {
    "rollout": [("env", "env"), ("model", "model"), ("seed", "seed"), ("rollout.*", "")],
    "eval": [
        ("env.name", "env.name"),
        ("env.max_turns", "env.max_turns"),
        ("env.settings", "env.settings"),
        ("env.step_timeout_s", "env.step_timeout_s"),
        ("model", "model"),
        ("seed", "seed"),
        ("eval.split", "env.split"),
        ("eval.episodes", "episodes", 0),  # 0: the run evaluated none; here all
        ("eval.temperature", "temperature"),
        ("rollout.engine", "engine"),
        ("rollout.vllm", "vllm"),
        ("rollout.gpus", "gpus"),
        ("rollout.device", "device"),
        ("rollout.dtype", "dtype"),
        ("rollout.threads", "threads"),
        ("rollout.batch_size", "batch_size"),
        ("rollout.sampling.max_new_tokens", "max_new_tokens"),
        ("rollout.sampling.coupled", "coupled"),
        ("rollout.prompt.history_turns", "history_turns"),
    ],
    "annotate": [("annotate.*", ""), ("seed", "seed")],
}


class RunFileReader:
    """Reads a run file (an ``OnlineConfig``, ``run_cls``; or ``--set`` keys in its layout) for one stage's command, by
    :data:`RUN_FILE_READS`; the file is checked as a whole run config first (an unknown key
    fails with the closest known one). ``ignored``: the file's top-level keys the command
    does not read, for :meth:`note`. A config resolver's ``reader`` (``config.resolve``)."""

    def __init__(self, command: str, cls, run_cls):
        self.command, self.reads, self.run_cls = command, RUN_FILE_READS[command], run_cls
        own = {f.name for f in dataclasses.fields(cls)}
        run = {f.name for f in dataclasses.fields(run_cls)}
        self.run_only, self.own_only = run - own, own - run
        self.ignored: list[str] = []

    def claims(self, data: dict) -> bool:
        """A run file: it has a key only a run config has (a section, iterations...)."""
        return any(key in self.run_only for key in data)

    def read(self, data: dict, where: str) -> dict:
        mixed = [key for key in data if key in self.own_only]
        if mixed:
            theirs = ", ".join(key for key in data if key in self.run_only)
            raise SerlError(
                f"{where} mixes the online loop's layout ({theirs}) with serl {self.command}'s own "
                f"({', '.join(mixed)}): use one layout per file"
            )
        cfgmod.from_dict(self.run_cls, data)  # every key known and of its type, as `serl train` would check
        out: dict = {}
        for src, dst, *unset in self.reads:
            if src.endswith(".*"):
                section = src[:-2]
                skip = LOOP_SETS.get(section, ())
                values = {k: v for k, v in (data.get(section) or {}).items() if k not in skip}
                out = cfgmod.merge(out, values)
                continue
            node, found = data, True
            for part in src.split("."):
                if not isinstance(node, dict) or part not in node:
                    found = False
                    break
                node = node[part]
            if not found or (unset and node == unset[0]):
                continue
            out = cfgmod.merge(out, cfgmod.nest({dst: node}))
        used = {src.split(".")[0] for src, *_ in self.reads}
        self.ignored += [key for key in data if key not in used and key not in self.ignored]
        return out

    def note(self) -> str | None:
        if not self.ignored:
            return None
        return f"note: ignoring {', '.join(self.ignored)} of the run config (not used by serl {self.command})"
