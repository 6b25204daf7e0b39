#!/usr/bin/env bash
# SmolLM2's learning pre-study (experiments/study/smollm2_prestudy.yaml; docs/MODELS.md, "Does it learn?"):
# the model fetched, the pretrained start scored on the panel as each seed's cells are (T 0.7, coupled sampling,
# the cell's seed), the 9 cells PARALLEL at a time (one torch thread each), the report and the paired analysis.
# Resumable: rerunning skips what is done. The summaries are kept under docs/results/smollm2/prestudy/.
set -euo pipefail
cd "$(dirname "$0")/../.."
PARALLEL="${PARALLEL:-2}"
R=runs/smollm2
K=docs/results/smollm2/prestudy
export SERL_THREADS=1
[ -f $R/model/config.json ] || serl model fetch smollm2-135m-instruct --out $R/model -q
for seed in 0 1 2; do
    [ -f $R/start-s$seed/eval.json ] || serl eval --config experiments/smollm2/sokoban.yaml --model $R/model \
        --split test --episodes 64 --max-turns 3 --seed $seed --set coupled=true --out $R/start-s$seed --threads 1 -q
done
serl ablate experiments/study/smollm2_prestudy.yaml --out $R/prestudy --parallel "$PARALLEL" -q
serl ablate --report $R/prestudy --keep $K -q
python experiments/smollm2/learning_analysis.py --start $R/start-s --grid $R/prestudy --out $K/analysis.json
