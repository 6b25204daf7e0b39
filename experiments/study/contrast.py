"""A paired contrast of an ablation's arms, seed by seed: sum(--plus arms) - sum(--minus arms).

    python experiments/study/contrast.py docs/results/sokoban_v3/mechanism \
        --plus serl-error+diff-feedback-plain-warm-start --minus grpo-plain-warm-start \
        --minus serl-error+diff-feedback --plus grpo

is the 2x2 interaction of study v3 (e): what SERL adds over GRPO from the plain warm start, minus what it adds
from the hindsight warm start. For the final success and the panel AUC (serl_cli.ablate.report) it prints the
mean contrast over the seeds every arm finished, its 95 % t-interval, the t-test p and Wilcoxon's signed-rank p.
"""

from __future__ import annotations

import argparse

from serl_cli.ablate.report import collect
from serl_cli.stats.paired import paired_t_test, wilcoxon_signed_rank


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="an ablation directory, or a folder of kept summaries")
    ap.add_argument("--plus", action="append", default=[], help="an arm counted +1 (repeatable)")
    ap.add_argument("--minus", action="append", default=[], help="an arm counted -1 (repeatable)")
    args = ap.parse_args()
    arms = collect(args.out)["arms"]
    missing = [a for a in args.plus + args.minus if a not in arms]
    if missing or not args.plus:
        raise SystemExit(f"error: unknown arm(s) {missing} (arms: {', '.join(arms)})" if missing else
                         "error: give at least one --plus arm")
    seeds = sorted(set.intersection(*(set(arms[a]["cells"]) for a in args.plus + args.minus)))
    print(f"{' + '.join(args.plus)}" + "".join(f" - {m}" for m in args.minus) + f"   ({len(seeds)} seeds)")
    for metric in ("success", "auc"):
        plus = [sum(arms[a]["cells"][s][metric] for a in args.plus) for s in seeds]
        minus = [sum(arms[a]["cells"][s][metric] for a in args.minus) for s in seeds]
        t, w = paired_t_test(plus, minus), wilcoxon_signed_rank(plus, minus)
        lo, hi = t["ci95"]
        print(f"  {metric:8s} {t['mean_diff']:+.3f} [{lo:+.3f}, {hi:+.3f}]  t-test p {t['p']:.3g}"
              + (f"  Wilcoxon p {w['p']:.3g}" if w else ""))


if __name__ == "__main__":
    main()
