"""The teacher signal of an annotated run, per turn, with 95 % intervals.

    python experiments/sokoban/teacher_signal_interval.py RUN [--model DIR]

Re-scores the expert's reply on every turn ``selection_report.json`` counted (the run's
annotation: its blocks, its prompt settings; the teacher is ``--model``, default the run's
policy) through ``serl_cli.method.teacher_signal.measure``, and reports the mean gain in the
expert reply's probability from the block with a t-interval over turns, and the
right-direction fraction with a Wilson interval.
"""

from __future__ import annotations

import argparse
import json
import math

from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_annotations, read_rollouts
from serl_cli.method import teacher_signal as ts
from serl_cli.method.annotation import action_format
from serl_cli.models.loading import load_model
from serl_cli.stats.summary import t_interval, wilson_interval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run")
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    rollout = io.load_manifest(args.run)["stages"]["rollout"]["config"]
    prompt = rollout.get("prompt") or {}
    model, tokenizer = load_model(args.model or rollout["model"])
    per_turn = {}
    summarize = ts.teacher_signal

    def capture(records, episodes, expert_logprobs):  # the per-turn log-probs measure() hands to the summary
        per_turn.update(expert_logprobs)
        return summarize(records, episodes, expert_logprobs)

    ts.teacher_signal = capture
    bare = bool(prompt.get("bare_replies"))
    summary = ts.measure(
        read_annotations(args.run),
        read_rollouts(args.run),
        model,
        tokenizer,
        1.0,
        16384,
        prompt.get("chat_template_kwargs"),
        bare,
        action_format(rollout["env"]) if bare else None,
    )
    gains = [math.exp(sum(w)) - math.exp(sum(wo)) for w, wo in per_turn.values()]
    n = len(gains)
    right = round(summary["right_direction"] * summary["turns"])
    print(
        json.dumps(
            {
                "turns": n,
                "expert_prob_gain": sum(gains) / n,
                "gain_ci95": t_interval(gains),
                "right_direction": summary["right_direction"],
                "right_direction_ci95": list(wilson_interval(right, summary["turns"])),
                "expert_prob_with_block": summary["expert_prob_with_block"],
                "expert_prob_without_block": summary["expert_prob_without_block"],
            }
        )
    )


if __name__ == "__main__":
    main()
