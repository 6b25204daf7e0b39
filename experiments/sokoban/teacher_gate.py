"""The teacher-signal gate of a Sokoban warm start (serl_cli.method.diagnostics.teacher_gate;
docs/studies/sokoban_v4.md).

    python experiments/sokoban/teacher_gate.py --model runs/v4/warm_start --seen runs/v4/expert --out runs/v4/gate

1. The panel: the model plays ``--rooms`` test rooms ``--group-size`` times each, sampled at T 1.0 as
   the online loop samples (``OUT/panel``, kept: a rerun reuses it).
2. Every turn is annotated with each block of study v4's SERL arms (the aligned oracle, the aligned
   reference, ``error,diff`` on the flagged turns), and the teacher signal measured on the turns
   whose state is not in ``--seen`` (the warm start's SFT data): held-out states.
3. The blind-copy check: a deadlocking move named as good, and its real feedback.

Writes ``OUT/gate.json`` and prints it; exits 1 when the aligned oracle misses the gate.

A model serl did not train (no ``serl_prompt.json``: a real pretrained model) is prompted and sampled as
``--config`` says (a run file's ``rollout.prompt`` and ``rollout.sampling``), and ``--blocks sources`` measures
each feedback source alone (``teacher_gate.SOURCE_BLOCKS``) instead of study v4's blocks:

    python experiments/sokoban/teacher_gate.py --model models/smollm2 --config experiments/smollm2/sokoban.yaml \
        --blocks sources --rooms 12 --max-turns 4 --out runs/smollm2/gate

A ``--config`` for WebShop or ALFWorld measures the gate there: the panel is that environment's evaluation split,
the shuffled control (Sokoban's moves) is left out, and the blind-copy check names an admissible action other than
the expert's (no deadlocks there). ``--unparsed whole`` scores a reply with no action whole, for a model that never
acts on that prompt (SmolLM2 on the paper's prompts):

    python experiments/sokoban/teacher_gate.py --model models/smollm2 --config experiments/smollm2/webshop.yaml \
        --blocks sources --unparsed whole --rooms 4 --max-turns 3 --out runs/smollm2/gate-webshop
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from serl_cli import api
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_rollouts
from serl_cli.method.annotation import action_format
from serl_cli.method.diagnostics import teacher_gate as gate
from serl_cli.models.loading import load_model
from serl_cli.rollout.engines import SamplingConfig
from serl_cli.rollout.prompts import PromptConfig, trained_prompt
from serl_cli.rollout.worlds import EnvConfig, build_world
from serl_cli.stages.rollout import RolloutConfig, run_rollout


def panel(
    model: str, out: Path, rooms: int, group_size: int, seed: int, how: RolloutConfig, max_turns: int | None
) -> Path:
    """The model's own episodes on ``rooms`` tasks of the environment's evaluation split (Sokoban's test rooms;
    WebShop's test goals, ALFWorld's ``valid_unseen`` games where ``--config`` names that environment)."""
    run = out / "panel"
    env = how.env.name
    split = build_world(EnvConfig(name=env, split=None, settings=how.env.settings)).eval_split
    if not (run / "manifest.json").is_file() or io.load_manifest(run)["stages"]["rollout"]["status"] != "done":
        run_rollout(
            RolloutConfig(
                env=EnvConfig(name=env, split=split, max_turns=max_turns, settings=how.env.settings),
                model=model,
                tasks=rooms,
                group_size=group_size,
                sampling=how.sampling,
                prompt=how.prompt,
                seed=seed,
                threads=1,
                out=str(run),
            )
        )
    return run


def prompting(model: str, config: str | None) -> RolloutConfig:
    """How the panel is prompted and sampled, and in which environment: Sokoban as the model was trained (its
    ``serl_prompt.json``) at T 1.0 with 3 new tokens, as the online loop samples a warm start; or as ``config``
    (a run file) says."""
    if config is not None:
        return api.load_config("rollout", [config])
    return RolloutConfig(
        env=EnvConfig(name="sokoban"),  # not RolloutConfig's own default environment (WebShop)
        sampling=SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=3),
        prompt=trained_prompt(model) or PromptConfig(),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seen", default=None, help="a run whose turns' states are left out (the SFT data)")
    ap.add_argument("--rooms", type=int, default=200)
    ap.add_argument("--group-size", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--config", default=None, help="a run file whose rollout prompt and sampling the panel uses")
    ap.add_argument("--max-turns", type=int, default=None, help="the panel's turn limit (default: Sokoban's, 15)")
    ap.add_argument("--blocks", choices=("v4", "sources"), default="v4", help="study v4's blocks, or each source")
    ap.add_argument(
        "--unparsed",
        choices=("none", "whole"),
        default="none",
        help="a reply with no action: not scored (none, the authors' rule), or scored whole (a model that never acts)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    how = prompting(args.model, args.config)
    run = panel(args.model, out, args.rooms, args.group_size, args.seed, how, args.max_turns)
    episodes = read_rollouts(run)
    env_cfg = io.load_manifest(run)["stages"]["rollout"]["config"]["env"]
    seen = {t.state_key for e in read_rollouts(args.seen) for t in e.turns} if args.seen else set()
    model, tokenizer = load_model(args.model)
    model.eval()
    bare = how.prompt.bare_replies
    fmt = action_format(env_cfg) if bare else None
    common = {"env_cfg": env_cfg, "seen": seen, "bare_replies": bare, "action_format": fmt}
    blocks = gate.BLOCKS if args.blocks == "v4" else gate.SOURCE_BLOCKS
    if env_cfg["name"] != "sokoban":  # the shuffled control draws among Sokoban's moves
        blocks = {name: settings for name, settings in blocks.items() if settings["sources"] != "shuffled"}
    result = {
        "model": args.model,
        "panel": {
            "rooms": args.rooms,
            "group_size": args.group_size,
            "seed": args.seed,
            "episodes": len(episodes),
            "turns": sum(e.num_turns for e in episodes),
            "successes": sum(e.success for e in episodes),
            "max_turns": args.max_turns,
            "config": args.config,
            "env": env_cfg["name"],
            "split": env_cfg["split"],
            "unparsed": args.unparsed,
        },
        "seen_states": len(seen),
        "blocks": {},
    }
    for name, settings in blocks.items():
        t0 = time.perf_counter()
        result["blocks"][name] = gate.signal_of(
            episodes, gate.block_config(settings, unparsed=args.unparsed), model, tokenizer, **common
        )
        result["blocks"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {json.dumps(result['blocks'][name])}", file=sys.stderr, flush=True)
    world = build_world(EnvConfig(**env_cfg))
    result["blind_copy"] = gate.blind_copy(
        episodes, model, tokenizer, world, env_cfg["split"], seen=seen, bare_replies=bare, action_format=fmt
    )
    result["gate"] = gate.gate_verdict(result["blocks"]["expert (aligned)"])
    io.write_json(out / "gate.json", result)
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["gate"]["met"] else 1)


if __name__ == "__main__":
    main()
