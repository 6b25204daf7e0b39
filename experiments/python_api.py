"""serl from Python: the pipeline of `serl demo`, scripted through the Python API (docs/API.md).

On Sokoban, the embedded default (no data to download), with a micro model built offline:

1. build the model (``api.init_model``: ``serl model init --preset micro``);
2. expert games on train rooms (``api.rollout``: ``serl rollout --policy expert``);
3. a short SFT warm start on them (``api.train``: ``serl train RUN --algo sft``);
4. a GRPO online loop from the warm start (``api.train_online``: ``serl train --iterations K``);
5. the warm start and the online policy on the test panel (``api.evaluate``: ``serl eval``);

then a short table. Every step writes the run directory its command would, under ``--out``.
At its default sizes it runs in seconds on one CPU thread: a smoke run of the API, not an
experiment (``serl demo`` has the sizes at which the model learns). Copy it into a notebook
and change the configs; each is a plain dataclass (``api.load_config`` reads YAML and
``--set``-style overrides the same way the CLI does).

    python experiments/python_api.py --out runs/python_api
"""

from __future__ import annotations

import argparse
from pathlib import Path

from serl_cli import api


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    out = Path(args.out)
    env = api.EnvConfig(name="sokoban", split="train")
    # what the policy reads: the grid alone, a bare move as the reply (as `serl demo` prompts a micro model)
    prompt = api.PromptConfig(history_turns=0, max_admissible=0, system=False, bare_replies=True)

    model = api.init_model(out / "model", preset="micro", env=env, seed=args.seed, overwrite=True)

    expert = api.rollout(
        api.RolloutConfig(
            env=env,
            model=str(model),
            policy="expert",
            tasks=args.expert_tasks,
            group_size=1,
            prompt=prompt,
            seed=args.seed,
            threads=args.threads,
            out=str(out / "expert"),
        ),
        overwrite=True,
    )
    print(f"expert data: {expert.summary['episodes']} episodes, {expert.summary['turns']} turns")

    sft = api.train(
        expert,  # a Run goes wherever a path does
        api.TrainConfig(
            algo="sft",
            epochs=1,
            mini_batches=args.sft_steps,
            optim=api.OptimConfig(lr=1e-3),
            seed=args.seed,
            threads=args.threads,
        ),
        overwrite=True,
    )
    print(f"warm start: {sft.summary['optimizer_steps']} SFT steps, loss {sft.summary['loss']:.3f} -> {sft.path}")

    online = api.OnlineConfig(
        env=env,
        model=str(sft.path),
        iterations=args.iterations,
        rollout=api.RolloutConfig(
            tasks=args.tasks,
            group_size=args.group_size,
            prompt=prompt,
            sampling=api.SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=3),
        ),
        train=api.TrainConfig(algo="grpo", optim=api.OptimConfig(lr=1e-4), threads=args.threads),
        seed=args.seed,
        out=str(out / "grpo"),
    )
    history = api.train_online(online, overwrite=True, on_iteration=lambda m: print(iteration_line(m)))

    rows = {}
    for name, policy in (("warm start", sft.path), ("warm start + grpo", Path(online.out) / "checkpoint")):
        rows[name] = api.evaluate(
            api.EvalConfig(
                env=api.EnvConfig(name="sokoban", split=None),  # the evaluation split: test rooms
                policy="model",
                model=str(policy),
                episodes=args.eval_episodes,
                temperature=0.4,
                history_turns=0,
                max_new_tokens=3,
                seed=args.seed,
                threads=args.threads,
                out=str(out / f"eval_{name.replace(' + ', '+').replace(' ', '_')}"),
            ),
            overwrite=True,
        )
    print(table(rows))
    return {"model": model, "expert": expert, "sft": sft, "online": history, "eval": rows}


def iteration_line(m: dict) -> str:
    return f"grpo iteration {m['iteration']}: reward {m['mean_reward']:.3f}, success {m['success_rate']:.3f}"


def table(rows: dict[str, dict]) -> str:
    """The evaluations side by side: success with its 95 % interval, turns."""
    lines = [f"{'policy':<20} {'success':>8} {'95% interval':>16} {'turns':>6}"]
    for name, s in rows.items():
        lo, hi = s["success_ci95"]
        lines.append(f"{name:<20} {s['success_rate']:>8.3f} {f'[{lo:.2f}, {hi:.2f}]':>16} {s['mean_turns']:>6.2f}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/python_api", help="the directory for every run of the script")
    p.add_argument("--expert-tasks", type=int, default=8, help="expert games for the warm start")
    p.add_argument("--sft-steps", type=int, default=2, help="SFT optimizer steps (one epoch)")
    p.add_argument("--iterations", type=int, default=2, help="GRPO iterations")
    p.add_argument("--tasks", type=int, default=2, help="rooms per GRPO iteration")
    p.add_argument("--group-size", type=int, default=2, help="games per room (GRPO's group)")
    p.add_argument("--eval-episodes", type=int, default=4, help="first rooms of the test panel")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    return p.parse_args(argv)


if __name__ == "__main__":
    main()
