#!/usr/bin/env bash
# Study v3 (docs/studies/sokoban_v3.md) end to end on 6x6 one-box Sokoban, on CPU: the warm starts, SFT alone on
# the panel, then the five grids of experiments/study/sokoban_v3_*.yaml, PARALLEL cells at a time (one torch
# thread each). Cells are resumable: rerunning the script skips what is done and resumes what was stopped.
# Arms shared between grids are trained once (`serl ablate --reuse` copies the finished cells).
# Afterwards each grid's summaries are kept under docs/results/sokoban_v3/ (`serl ablate --report --keep`),
# and its report is rebuilt from them alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
PARALLEL="${PARALLEL:-2}"
S=runs/study-v3
export SERL_THREADS=1

# 1. the noisy-expert data and the two warm starts, side by side: with hindsight SFT on error,diff blocks
#    (the teacher-capable start every arm uses) and without (the mechanism arm of (e))
[ -f $S/expert/rollouts.jsonl ] || serl rollout --config experiments/sokoban/expert.yaml --out $S/expert --threads 1 -q
[ -d $S/expert_plain ] || cp -r $S/expert $S/expert_plain  # one training per run directory (its metrics, its lock)
[ -f $S/warm_start/config.json ] || serl train $S/expert --config experiments/sokoban/warm_start_hindsight.yaml \
    --out $S/warm_start --threads 1 -q --overwrite & hindsight=$!
[ -f $S/warm_start_plain/config.json ] || serl train $S/expert_plain --config experiments/sokoban/warm_start.yaml \
    --out $S/warm_start_plain --threads 1 -q --overwrite & plain=$!
wait $hindsight; wait $plain  # either one failing stops the script (set -e)

# 2. SFT alone: the warm start on the panel, decoded as every cell's final evaluation (T 0.4, seed 0)
for ws in warm_start warm_start_plain; do
    [ -f $S/sft-alone/$ws/eval.json ] || serl eval --config experiments/sokoban/study_v3.yaml --model $S/$ws \
        --seed 0 --out $S/sft-alone/$ws --threads 1 -q
done

# 3. the grids; a grid's shared arms are copied from the grid that trained them first
grid() {  # grid NAME [SOURCE_GRID ...]: reuse finished cells from the sources, run the rest, report
    local name=$1; shift
    local reuse=(); for src in "$@"; do reuse+=(--reuse "$S/$src"); done
    serl ablate "experiments/study/sokoban_v3_$name.yaml" --out "$S/$name" "${reuse[@]}" --parallel "$PARALLEL" -q
}
# in order of what each answers first: (a), then (e) and (c) (the mechanism and the falsification test), then (d), (b)
grid methods
grid mechanism methods
grid placement mechanism
grid granularity methods
grid sources methods placement

# 4. the committed summaries, and the reports rebuilt from them alone
mkdir -p docs/results/sokoban_v3/sft_alone
for ws in warm_start warm_start_plain; do
    python -c "import json, sys; d = json.load(open(sys.argv[1])); d.pop('by_task', None); json.dump(d, open(sys.argv[2], 'w'), indent=2)" \
        $S/sft-alone/$ws/eval.json docs/results/sokoban_v3/sft_alone/$ws.json
done
for g in methods mechanism placement granularity sources; do
    serl ablate --report $S/$g --keep docs/results/sokoban_v3/$g -q
done
