"""One online iteration on Sokoban, timed by its parts: rollout, SERL annotation, update.

    python -m benchmarks.online_sokoban [--preset micro] [--model DIR] [--tasks 8] [--group-size 8]
                                        [--repeats 2] [--threads 1] [--seed 0] [--out FILE]

What ``serl train --iterations K --algo serl`` does once (``serl_cli.online.loop``), with
the settings of ``serl demo`` on Sokoban (``serl_cli.demo.config.DemoConfig``: the compact
prompt, bare replies, its sampling, annotation and learning rate): ``run_rollout`` of
``--tasks`` rooms x ``--group-size`` episodes with the policy in memory, then
``annotate_episodes`` with a frozen copy of the policy as the teacher (the online loop's
teacher at a sync), then ``Learner.update``. The target (docs/RESULTS.md): 8 rooms x 8,
one thread, at most 15 s, so that a 100-iteration run fits in half an hour.

The model: by default the embedded ``--preset`` model as built, with random weights. It
never solves a room, so every episode runs to the turn limit -- the most turns an
iteration can have: the most rollout and update work. Its rewards would all be 0 (every
advantage 0: the update would skip everything), so, as in ``benchmarks.train_step``, the
outcome is overwritten in memory: in every group the episodes with ``rollout_index < G // 2``
succeed. Every reply of random weights is malformed, though, and a reply with no parseable
action has no action tokens to weight (``annotate.tokens: action``, ``unparsed: none``, the
authors' defaults), so the teacher scores nothing: the annotate figure is the cost of the
blocks alone. With ``--model`` (the demo's warm start, say) the rollouts, rewards and
teacher work are the model's own -- that is the figure with the teacher in it.

Each repeat is a fresh iteration (its own rollout seed) from the same weights; the median
of each part is reported, in CPU seconds of the process (``benchmarks.common.Stopwatch``:
the machine is shared), with wall-clock seconds in the JSON.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import Stopwatch, report
from serl_cli.artifacts import io
from serl_cli.artifacts.records import Episode
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.demo.config import DemoConfig
from serl_cli.method.annotation import annotate_episodes
from serl_cli.rollout.default_model import default_model_dir
from serl_cli.rollout.engines import make_engine
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.rollout import run_rollout
from serl_cli.training.checkpoint import frozen_copy
from serl_cli.training.learner import Learner

PARTS = ("rollout", "annotate", "update")


@dataclass
class OnlineBench:
    preset: str = "micro"  # the embedded default for Sokoban, the demo's
    model: str | None = None  # None: the embedded preset model, random weights, with synthetic rewards
    tasks: int = 8
    group_size: int = 8
    repeats: int = 2
    threads: int = 1
    seed: int = 0


def iteration_configs(cfg: OnlineBench):
    """The demo's rollout, annotate and train settings, sized and seeded for the benchmark."""
    demo = DemoConfig()
    rollout, train, annotate = (
        copy.deepcopy(demo.online.rollout),
        copy.deepcopy(demo.online.train),
        copy.deepcopy(demo.online.annotate),
    )
    rollout.env, rollout.prompt = EnvConfig(name="sokoban", split="train"), demo.prompt
    rollout.tasks, rollout.group_size, rollout.threads = cfg.tasks, cfg.group_size, cfg.threads
    train.algo, train.seed, train.threads = "serl", cfg.seed, cfg.threads
    annotate.threads = cfg.threads
    return rollout, train, annotate


def synthetic_outcomes(episodes: list[Episode], group_size: int) -> None:
    """Half of every group succeeds (in memory): the random-weight model's advantages would all be 0."""
    for e in episodes:
        won = e.rollout_index < group_size // 2
        e.reward, e.success = float(won), won


def measure(cfg: OnlineBench) -> dict:
    rollout, train, annotate = iteration_configs(cfg)
    world = build_world(rollout.env)
    model = cfg.model or str(default_model_dir(world, "sokoban", cfg.preset))
    learner = Learner(model, train)
    start = copy.deepcopy(learner.model.state_dict())
    teacher = frozen_copy(learner.model)
    engine = make_engine("hf", learner.model, learner.tokenizer)
    temperature = rollout.sampling.temperature or 1.0
    runs = []
    with tempfile.TemporaryDirectory(prefix="serl-online-bench-") as tmp:
        for k in range(cfg.repeats):
            learner.model.load_state_dict(start)  # every repeat from the same weights
            rcfg = copy.deepcopy(rollout)
            rcfg.seed, rcfg.out = cfg.seed * 1000 + k, str(Path(tmp) / f"iter_{k}")
            watches, run = {}, {}
            with Stopwatch() as watches["rollout"]:
                summary = run_rollout(
                    rcfg, overwrite=True, model=learner.model, tokenizer=learner.tokenizer, engine=engine
                )
                episodes = read_rollouts(rcfg.out)
            if cfg.model is None:
                synthetic_outcomes(episodes, cfg.group_size)
            with Stopwatch() as watches["annotate"]:
                records, stats = annotate_episodes(
                    episodes,
                    annotate,
                    teacher,
                    learner.tokenizer,
                    env_cfg=io.to_plain(rcfg.env),
                    temperature=temperature,
                    bare_replies=rcfg.prompt.bare_replies,
                )
            with Stopwatch() as watches["update"]:
                metrics = learner.update(
                    episodes, temperature, records, {"config": io.to_plain(annotate), "stats": stats}
                )
            for part, w in watches.items():
                run[f"{part}_cpu_s"], run[f"{part}_wall_s"] = w.cpu_s, w.wall_s
            run.update(
                episodes=summary["episodes"],
                turns=summary["turns"],
                success_rate=summary["success_rate"],
                teacher_turns_scored=stats["teacher_turns_scored"],
                turns_with_gradient=metrics["turns_with_gradient"],
                prompt_tokens=sum(len(t.prompt_ids) for e in episodes for t in e.turns) / summary["turns"],
            )
            runs.append(run)

    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    parts = {p: {"cpu_s": median(f"{p}_cpu_s"), "wall_s": median(f"{p}_wall_s")} for p in PARTS}
    return {
        "config": vars(cfg),
        "model": model,
        "synthetic_rewards": cfg.model is None,
        "runs": runs,
        "parts": parts,
        "iteration_cpu_s": statistics.median(sum(r[f"{p}_cpu_s"] for p in PARTS) for r in runs),
        "iteration_wall_s": statistics.median(sum(r[f"{p}_wall_s"] for p in PARTS) for r in runs),
        "turns": median("turns"),
        "mean_prompt_tokens": median("prompt_tokens"),
        "teacher_turns_scored": median("teacher_turns_scored"),
    }


def rows(data: dict) -> list[list]:
    out = [[part, s["cpu_s"], s["wall_s"]] for part, s in data["parts"].items()]
    return out + [["iteration (target <= 15 s)", data["iteration_cpu_s"], data["iteration_wall_s"]]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = OnlineBench()
    for name in ("preset", "model", "tasks", "group_size", "repeats", "threads", "seed"):
        default = getattr(defaults, name)
        ap.add_argument(
            f"--{name.replace('_', '-')}", type=type(default) if default is not None else str, default=default
        )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cfg = OnlineBench(**{k: v for k, v in vars(args).items() if k != "out"})
    data = measure(cfg)
    what = "random weights, synthetic rewards" if data["synthetic_rewards"] else cfg.model
    report(
        "online_sokoban",
        f"One SERL online iteration on Sokoban ({cfg.tasks} rooms x {cfg.group_size}, {cfg.preset} "
        f"preset, {what}; {data['turns']:.0f} turns, {data['mean_prompt_tokens']:.0f} prompt tokens a turn, "
        f"{data['teacher_turns_scored']:.0f} scored by the teacher; {cfg.threads} thread(s))",
        ["part", "CPU s", "wall s"],
        rows(data),
        data,
        args.out,
    )


if __name__ == "__main__":
    main()
