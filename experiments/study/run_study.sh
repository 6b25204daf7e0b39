#!/usr/bin/env bash
# The small-scale study of docs/RESULTS.md, end to end, on the real WebShop 1k catalog
# (SERL_DATA_DIR must point at the data). Every number in docs/RESULTS.md comes from the
# artifacts this writes under runs/study/. One torch thread per process; PARALLEL cells at a time.
set -euo pipefail
cd "$(dirname "$0")/../.."
PARALLEL="${PARALLEL:-2}"
S=runs/study
export SERL_THREADS=1

# 1. the warm start (the "SFT alone" arm): 400 expert episodes of the train split, 10-turn limit,
#    no history in the prompt; 6 epochs x 64 optimizer steps at lr 2e-3 on the embedded tiny model
serl rollout --policy expert --tasks 400 --group-size 1 --set env.max_turns=10 --set prompt.history_turns=0 \
    --out $S/expert --threads 1
serl train $S/expert --algo sft --set train.epochs=6 --set train.mini_batches=64 --set train.optim.lr=2e-3 \
    --threads 1                                                  # -> $S/expert/checkpoint
serl eval --model $S/expert/checkpoint --env webshop --split test --episodes 20 --set env.max_turns=8 --set max_new_tokens=24 \
    --out $S/sft-eval --threads 1

# 2. the grids: (a) baselines, (b) feedback sources, (c) placement -- 5 seeds per arm
for grid in baselines placement sources; do
    serl ablate experiments/study/webshop_$grid.yaml --out $S/webshop-$grid --parallel "$PARALLEL" -q
    serl ablate --report $S/webshop-$grid
done
