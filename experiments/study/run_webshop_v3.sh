#!/usr/bin/env bash
# Study v3 on WebShop (docs/studies/sokoban_v3.md, "WebShop"): question (a) on the real 1k catalog, on CPU, at the scale the
# budget allows. Needs SERL_DATA_DIR (the catalog). Resumable: rerunning skips what is done.
#   the noisy expert's data -> the warm start (SFT, one epoch) -> SFT alone on the test panel
#   -> the grid experiments/study/webshop_v3_methods.yaml -> summaries kept under docs/results/webshop_v3/
set -euo pipefail
cd "$(dirname "$0")/../.."
PARALLEL="${PARALLEL:-2}"
S=runs/webshop-v3
export SERL_THREADS=1
mkdir -p $S

# 1. 400 train tasks played by the expert with random detours on 20 % of turns (marked off_expert: SFT skips
#    them, so the data shows recoveries from the states a learner's mistakes lead to)
[ -f $S/expert/rollouts.jsonl ] || serl rollout --env webshop --policy expert --tasks 400 --group-size 1 \
    --set env.max_turns=10 --set prompt.history_turns=0 --set expert_noise=0.2 --out $S/expert --threads 1 -q
# 2. the warm start: the embedded tiny model, one epoch in 48 steps (no hindsight SFT: on WebShop's pages it would
#    more than double the tokens, and the budget has no room for it; docs/RESULTS.md)
[ -f $S/warm_start/config.json ] || serl train $S/expert --algo sft --set train.epochs=1 --set train.mini_batches=48 \
    --set train.optim.lr=2e-3 --out $S/warm_start --threads 1 -q --overwrite
# 3. SFT alone: the warm start on the grid's final-evaluation panel (the first 20 test tasks, 8 turns, T 0.4, seed 0)
[ -f $S/sft-alone/eval.json ] || serl eval --model $S/warm_start --env webshop --split test --episodes 20 \
    --set env.max_turns=8 --set max_new_tokens=48 --set history_turns=0 \
    --set temperature=0.4 --seed 0 --out $S/sft-alone --threads 1 -q
# 4. the grid, then its summaries kept and the report rebuilt from them alone
serl ablate experiments/study/webshop_v3_methods.yaml --out $S/methods --parallel "$PARALLEL" -q
mkdir -p docs/results/webshop_v3
python -c "import json, sys; d = json.load(open(sys.argv[1])); d.pop('by_task', None); json.dump(d, open(sys.argv[2], 'w'), indent=2)" \
    $S/sft-alone/eval.json docs/results/webshop_v3/sft_alone.json
serl ablate --report $S/methods --keep docs/results/webshop_v3/methods -q
