"""The embedded default model: a small model built on first use for an environment, cached.

``serl rollout --env webshop`` with no ``--model`` uses it: the ``tiny`` preset, or the
preset the environment names (``model_preset``: Sokoban's 6x6 grids need only ``micro``).
Its tokenizer is trained on the text the policy will read and write: prompts rendered
from expert episodes on the train split (system rules, instructions, pages, admissible
actions) and the environment's own text (the catalog's products, Sokoban's feedback). The
cache lives in ``$SERL_CACHE_DIR`` (default ``~/.cache/serl``), keyed by environment, preset, data
source and seed, so a changed catalog builds a new model.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

from envs.base import Cataloged, CorpusTasks, CorpusTexts, ModelPreset
from serl_cli.rollout.prompts import PromptConfig, action_format_of, build_messages, format_action
from serl_cli.rollout.runner import EpisodeSpec, run_episodes


def cache_root() -> Path:
    return Path(os.environ.get("SERL_CACHE_DIR") or Path.home() / ".cache" / "serl")


def tokenizer_corpus(world, episodes: int = 300) -> list[str]:
    """Prompts and replies of expert episodes on the train split (else the eval split), plus the
    environment's own text."""
    from serl_cli.rollout.policies import ExpertPolicy

    split = "train" if "train" in world.splits() else world.eval_split  # a plugin environment may have no train split
    n = min(episodes, world.num_tasks(split))
    # an environment whose episodes are slow to start (ALFWorld) picks a few tasks of each kind
    tasks = world.corpus_tasks(split) if isinstance(world, CorpusTasks) else range(n)
    records = run_episodes(world, split, [EpisodeSpec(task_id=i) for i in tasks], ExpertPolicy())
    texts = []
    for rec in records:
        history: list[dict] = []
        for t in rec.turns:
            messages = build_messages(
                world.rules, rec.instruction, history, t.observation, [], PromptConfig(), action_format_of(world)
            )
            texts += [m["content"] for m in messages] + [format_action(t.action)]
            history.append({"observation": t.observation, "action": t.action})
    return texts + (world.corpus_texts() if isinstance(world, CorpusTexts) else [])


def default_model_dir(world, env_name: str, preset: str | None = None, seed: int = 0) -> Path:
    """The cached default model for an environment, built now if absent: ``preset``, else the
    world's own ``model_preset`` (Sokoban: ``micro``), else ``tiny``."""
    from serl_cli.models.tiny import init_model

    preset = preset or (world.model_preset if isinstance(world, ModelPreset) else "tiny")
    source = world.catalog.source if isinstance(world, Cataloged) else env_name
    key = hashlib.sha1(f"{env_name}|{preset}|{source}|{seed}".encode()).hexdigest()[:10]
    path = cache_root() / "models" / f"{env_name}-{preset}-{key}"
    if (path / "config.json").is_file():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # many processes (an ablation's array tasks) may start at once: one builds, the others wait
    with open(path.parent / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            init_model(preset, path, tokenizer_corpus(world), seed=seed, overwrite=path.exists())
    return path
