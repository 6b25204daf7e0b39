#!/usr/bin/env bash
# The small-scale study of docs/RESULTS.md, end to end, on the real WebShop 1k catalog and on ALFWorld
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
serl eval --model $S/expert/checkpoint --env webshop --split test --episodes 20 --set env.max_turns=8 --set max_new_tokens=48 \
    --out $S/sft-eval --threads 1

# 2. the grids: (a) baselines, (c) placement, (b) feedback sources -- 5 seeds per arm. (c)'s `feedback` arm is
#    (a)'s SERL arm (same base config and seeds), so its finished cells are copied in and skipped.
ablate() { serl ablate "experiments/study/$1.yaml" --out "$S/${1//_/-}" --parallel "$PARALLEL" -q; serl ablate --report "$S/${1//_/-}"; }
reuse() { mkdir -p "$S/$2/cells"; for c in "$S/$1"/cells/*-serl-ref_or_error-step-feedback-s*; do cp -rn "$c" "$S/$2/cells/"; done; }
ablate webshop_baselines
reuse webshop-baselines webshop-placement
ablate webshop_placement
ablate webshop_sources

# 3. ALFWorld (SERL_DATA_DIR/alfworld; the extra serl[alfworld]). Warm start: the expert on all 180 train games
#    (50-turn limit, the last turn in the prompt), then filtered behaviour cloning on its successful episodes:
#    3 epochs x 32 optimizer steps at lr 2e-3 on the embedded tiny ALFWorld model.
serl rollout --env alfworld --policy expert --tasks 180 --group-size 1 --set prompt.history_turns=1 \
    --out $S/alf-expert --threads 1
serl train $S/alf-expert --algo sft --set train.sft_successful_only=true --set train.epochs=3 \
    --set train.mini_batches=32 --set train.optim.lr=2e-3 --threads 1    # -> $S/alf-expert/checkpoint
serl eval --model $S/alf-expert/checkpoint --env alfworld --split valid_unseen --episodes 20 --panel spread --set env.max_turns=12 \
    --set max_new_tokens=16 --out $S/alf-sft-eval --threads 1
ablate alfworld_baselines
reuse alfworld-baselines alfworld-placement
ablate alfworld_placement
ablate alfworld_sources
