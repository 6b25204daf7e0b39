"""The teacher signal of an annotated run, per turn, with 95 % intervals.

    python experiments/sokoban/teacher_signal_interval.py RUN [--model DIR]

Re-scores the expert's reply on every turn ``selection_report.json`` counted (the run's
annotation: its blocks, its prompt settings; the teacher is ``--model``, default the run's
policy) on the annotation's teacher prompts (``serl_cli.method.teacher_signal``), and reports the mean gain in the
expert reply's probability from the block with a t-interval over turns, and the
right-direction fraction with a Wilson interval.
"""

from __future__ import annotations

import argparse
import json

from serl_cli.artifacts import io
from serl_cli.artifacts.schema import read_annotations, read_rollouts
from serl_cli.method import teacher_signal as ts
from serl_cli.method.annotation import action_format, teacher_prompts
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
    records, episodes = read_annotations(args.run), read_rollouts(args.run)
    turns = ts.signal_turns(records, episodes)
    prompt_ids = [t.prompt_ids for e in episodes for t in e.turns]  # record order is turn order
    prompts = teacher_prompts(records, prompt_ids, tokenizer, turns, prompt.get("chat_template_kwargs"))
    bare = bool(prompt.get("bare_replies"))
    fmt = action_format(rollout["env"]) if bare else None
    scored = ts.expert_logprobs(records, episodes, prompts, ts.SpanScoring(model, tokenizer, 1.0, 16384, bare, fmt))
    rows = ts.signal_rows(records, episodes, scored)
    summary = ts.summarize(rows)
    gains = [r["p_with"] - r["p_without"] for r in rows]
    right = sum(r["right"] for r in rows)
    print(
        json.dumps(
            {
                "turns": len(rows),
                "expert_prob_gain": summary["expert_prob_gain"],
                "gain_ci95": t_interval(gains),
                "right_direction": summary["right_direction"],
                "right_direction_ci95": list(wilson_interval(right, len(rows))),
                "expert_prob_with_block": summary["expert_prob_with_block"],
                "expert_prob_without_block": summary["expert_prob_without_block"],
            }
        )
    )


if __name__ == "__main__":
    main()
