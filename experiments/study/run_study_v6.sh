#!/usr/bin/env bash
# Study v6 (docs/studies/sokoban_v6.md, pre-registered): does what SERL's block says matter? On a train split
# that holds no test-panel room (env.settings.disjoint_rooms), three warm starts of v4's reading recipe (SFT seeds
# 0-2, one noisy-expert data set), each with its gate (the shuffled block's included), SFT alone on the 500-room
# panel and the mechanism figures of a first loose update (the oracle's); then per start the grid of
# experiments/study/sokoban_v6_sft<k>.yaml (GRPO, SERL-oracle loose, SERL-shuffled loose; 10 seeds, 30 cells),
# PARALLEL cells at a time (one torch thread each), and the pre-registered analysis over the three.
# Resumable: rerunning skips what is done; STARTS="2" runs only the starts named. Summaries are kept under docs/results/sokoban_v6/sft<k>/.
# No start is replaced and no seed added, whatever a gate or a cell says.
set -euo pipefail
cd "$(dirname "$0")/../.."
PARALLEL="${PARALLEL:-2}"
V=runs/study-v6
K=docs/results/sokoban_v6
export SERL_THREADS=1
DISJOINT="--set env.settings.disjoint_rooms=true"

# 1. the noisy expert's games on train rooms none of which is a panel room (v4's expert.yaml otherwise)
# shellcheck disable=SC2086
[ -f $V/expert/rollouts.jsonl ] || serl rollout --config experiments/sokoban/expert.yaml $DISJOINT --out $V/expert \
    --threads 1 -q

for k in ${STARTS:-0 1 2}; do
    W=$V/warm_start-sft$k
    mkdir -p $K/sft$k/diagnostics
    # 2. the reading warm start (v4's recipe), SFT seed k; each on its own copy of the data (a run keeps its books)
    [ -d $V/expert_reading-sft$k ] || cp -r $V/expert $V/expert_reading-sft$k
    [ -f $W/config.json ] || serl train $V/expert_reading-sft$k --config experiments/sokoban/warm_start_reading.yaml \
        --seed $k --out $W --threads 1 -q --overwrite
    # 3. its gate on held-out panel states (the aligned oracle, ref, error,diff and the shuffled oracle); recorded,
    #    not a stop: every start runs
    [ -f $V/gate-sft$k/gate.json ] || python experiments/sokoban/teacher_gate.py --model $W --seen $V/expert \
        --out $V/gate-sft$k > /dev/null || true
    cp $V/gate-sft$k/gate.json $K/sft$k/gate.json
    # 4. SFT alone on the whole panel, as every cell's final evaluation decodes (T 0.4, seed 0)
    # shellcheck disable=SC2086
    [ -f $V/sft-alone-sft$k/eval.json ] || serl eval --config experiments/sokoban/study_v4.yaml $DISJOINT --model $W \
        --episodes 500 --seed 0 --out $V/sft-alone-sft$k --threads 1 -q
    python -c "import json, sys; d = json.load(open(sys.argv[1])); d.pop('by_task', None); json.dump(d, open(sys.argv[2], 'w'), indent=2)" \
        $V/sft-alone-sft$k/eval.json $K/sft$k/sft_alone.json
    # 5. the first loose update with the oracle on the gate's panel: the alignment gap of the exploratory analysis
    #    (cos_added_sft - cos_grpo_sft); over 17 CPU minutes on the 2-core machine
    [ -f $K/sft$k/diagnostics/loose.json ] || python experiments/sokoban/update_diagnostics.py $V/gate-sft$k/panel \
        --model $W --sources expert --weight-clip 1.0 --mixing-lambda 1.0 > $K/sft$k/diagnostics/loose.json.tmp
    [ -f $K/sft$k/diagnostics/loose.json ] || mv $K/sft$k/diagnostics/loose.json.tmp $K/sft$k/diagnostics/loose.json
    # 6. the start's grid; a rebuilt machine resumes from the kept summaries
    KEPT=()
    [ -f $K/sft$k/grid.json ] && KEPT+=(--reuse $K/sft$k)
    serl ablate experiments/study/sokoban_v6_sft$k.yaml --out $V/grid-sft$k "${KEPT[@]}" --parallel "$PARALLEL" -q
    serl ablate --report $V/grid-sft$k --keep $K/sft$k -q
done

# 7. the pre-registered analysis over the three starts
python experiments/study/sokoban_v6_analysis.py $K > $K/analysis.json
