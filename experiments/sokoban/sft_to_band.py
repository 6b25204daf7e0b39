"""The SFT part of ``serl demo`` alone, on one seed, with its optimizer settings changed: how the demo's SFT is tuned.

    python experiments/sokoban/sft_to_band.py --seed S [--set sft.optim.lr=5e-4 ...] --out DIR

Runs the demo's steps 1-3 exactly as ``serl demo --seed S`` would (``demo.pipeline``): the embedded
micro model, the noisy-expert data of seed S (kept in ``DIR/../expert-seedS`` and reused by the next
setting), and SFT up to the warm-start band with a check on the validation rooms every 25 steps.
``--set`` takes the demo's own keys (``sft.*``, ``warm_start.*``), so a setting found here is one
``--set`` away from the demo. Nothing of the test panel is played.

Prints one JSON line, also appended to ``DIR/../sft_to_band.jsonl``: the step the band chose, its
validation success, the outcome (in the band, stepped over it, ended below it), the wall time, and
the whole curve of (step, validation success). SFT runs on one thread, so two settings run side by
side on a 2-core machine and the curve does not depend on the other.
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import time
from pathlib import Path

from serl_cli.config import resolve
from serl_cli.demo.config import DemoConfig, expert_data_config
from serl_cli.rollout.default_model import default_model_dir
from serl_cli.rollout.worlds import build_world
from serl_cli.stages.rollout import run_rollout
from serl_cli.stages.warm_start import sft_to_band


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a demo setting (sft.*, warm_start.*)"
    )
    ap.add_argument("--out", required=True, help="this setting's run directory (replaced)")
    args = ap.parse_args()

    cfg = resolve(DemoConfig, config_file=None, flags={"seed": args.seed, "threads": 1}, overrides=args.set)
    world = build_world(cfg.env)
    model = cfg.model or str(default_model_dir(world, cfg.env.name, cfg.preset))
    out = Path(args.out)
    data = out.parent / f"expert-seed{cfg.seed}"
    if not (data / "rollouts.jsonl").is_file():  # the demo's step 2, once per seed
        run_rollout(expert_data_config(cfg, model, data), overwrite=True)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(data, out)
    sft = copy.deepcopy(cfg.sft)  # as demo.pipeline._warm_start sets it
    sft.threads, sft.seed, sft.model = cfg.threads, cfg.seed, model
    started = time.perf_counter()
    w = sft_to_band(str(out), sft, cfg.warm_start, cfg.env, overwrite=True, log=lambda *_: None)
    row = {
        "seed": cfg.seed,
        "set": args.set,
        "step": w["step"],
        "success": w["success"],
        "outcome": w["outcome"],
        "wall_s": round(time.perf_counter() - started, 1),
        "curve": [[r["step"], r["success"]] for r in w["curve"]],
    }
    print(json.dumps(row))
    with open(out.parent / "sft_to_band.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
