"""The mechanism figures of one SERL update on one batch (serl_cli.method.diagnostics.update).

    python experiments/sokoban/update_diagnostics.py RUN --model DIR [--sources expert --trajectory aligned
        --placement all --weight-clip 0.2 --mixing-lambda 0.5]

RUN holds rollouts of the policy DIR (the gate's panel, ``runs/v4/gate/panel``, or an online
iteration's ``iter_k`` with the checkpoint that played it). They are annotated here as an online
iteration annotates them (the teacher: DIR; the advantage: ``--group-norm``, study v4's
``cross_steps``), and the figures printed as JSON: the weights' distribution and the fraction at the
clip, the advantage mass moved, and the cosines between SERL's, GRPO's and the SFT-toward-the-expert
updates on this batch.
"""

from __future__ import annotations

import argparse
import json

from serl_cli.algos.objectives import turn_advantages
from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_rollouts, turn_samples
from serl_cli.method.annotation import AnnotateConfig, annotate_episodes
from serl_cli.method.diagnostics.update import update_figures
from serl_cli.models.loading import load_model
from serl_cli.training.train_config import TrainConfig


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--model", required=True)
    ap.add_argument("--sources", default="expert")
    ap.add_argument("--trajectory", default="aligned")
    ap.add_argument("--placement", default="all")
    ap.add_argument("--weight-clip", type=float, default=0.2)
    ap.add_argument("--mixing-lambda", type=float, default=0.5)
    ap.add_argument("--group-norm", default="cross_steps")
    args = ap.parse_args(argv)
    rollout = io.load_manifest(args.run)["stages"]["rollout"]["config"]
    bare = bool((rollout.get("prompt") or {}).get("bare_replies"))
    episodes = read_rollouts(args.run)
    model, tokenizer = load_model(args.model)
    model.eval()
    cfg = AnnotateConfig(
        sources=args.sources,
        trajectory=args.trajectory,
        placement=args.placement,
        weight_clip=args.weight_clip,
        mixing_lambda=args.mixing_lambda,
        lambda_decay_steps=0,
        teacher_signal=False,
    )
    train = TrainConfig(algo="serl", group_norm=args.group_norm)  # the advantage as an online iteration computes it
    advantages = turn_advantages(turn_samples(episodes), train).tolist()
    records, _ = annotate_episodes(
        episodes, cfg, model, tokenizer, env_cfg=rollout["env"], advantages=advantages, bare_replies=bare
    )
    figures = update_figures(
        model, tokenizer, episodes, records, weight_clip=args.weight_clip, lam=args.mixing_lambda, bare_replies=bare
    )
    result = {"run": args.run, "model": args.model, "settings": vars(args), **figures}
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
