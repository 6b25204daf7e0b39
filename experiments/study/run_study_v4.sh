#!/usr/bin/env bash
# Study v4 (docs/studies/sokoban_v4.md) end to end on 6x6 one-box Sokoban, on CPU: the noisy-expert data,
# the reading-capable warm start, the teacher-signal gate (the script stops if the teacher does not read), SFT alone
# on the panel, the mechanism figures of a first update, then the grid of experiments/study/sokoban_v4.yaml,
# PARALLEL cells at a time (one torch thread each). Cells are resumable: rerunning the script skips what is done
# and resumes what was stopped. Afterwards the summaries are kept under docs/results/sokoban_v4/
# (`serl ablate --report --keep`), and the report is rebuilt from them alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
PARALLEL="${PARALLEL:-2}"
S=runs/study-v4
K=docs/results/sokoban_v4
export SERL_THREADS=1

# 1. the noisy-expert data and the reading-capable warm start (SFT + reading SFT on expert; ref; error,diff blocks)
[ -f $S/expert/rollouts.jsonl ] || serl rollout --config experiments/sokoban/expert.yaml --out $S/expert --threads 1 -q
[ -d $S/expert_reading ] || cp -r $S/expert $S/expert_reading  # one training per run directory (its metrics, its lock)
[ -f $S/warm_start/config.json ] || serl train $S/expert_reading --config experiments/sokoban/warm_start_reading.yaml \
    --out $S/warm_start --threads 1 -q --overwrite

# 2. the gate: on held-out panel states (200 test rooms x 2 rollouts, states of the SFT data left out) the teacher
#    shown the aligned oracle must move the right way on >= 0.9 of the turns and gain >= +0.3 on the expert's move
[ -f $S/gate/gate.json ] || python experiments/sokoban/teacher_gate.py --model $S/warm_start --seen $S/expert \
    --out $S/gate > /dev/null || true
python -c "import json, sys; g = json.load(open(sys.argv[1]))['gate']; sys.exit(0 if g['met'] else f'gate not met: {g}')" \
    $S/gate/gate.json

# 3. SFT alone: the warm start on the panel, decoded as every cell's final evaluation (T 0.4, seed 0)
[ -f $S/sft-alone/eval.json ] || serl eval --config experiments/sokoban/study_v4.yaml --model $S/warm_start \
    --seed 0 --out $S/sft-alone --threads 1 -q

# 4. the mechanism figures of a first update on the gate's panel: the oracle's weights at both bounds
mkdir -p $S/diagnostics
for bounds in "authors 0.2 0.5" "loose 1.0 1.0"; do
    set -- $bounds
    [ -f $S/diagnostics/oracle-$1.json ] || python experiments/sokoban/update_diagnostics.py $S/gate/panel \
        --model $S/warm_start --weight-clip $2 --mixing-lambda $3 > $S/diagnostics/oracle-$1.json
done

# 5. the grid, in two passes: first every arm on seeds 0-4, then the full grid (seeds 0-9), which reuses the first
#    pass's cells and fills seeds 5-9 arm by arm (arm-major: GRPO and the oracle arms first). Stopped for time
#    after the first pass, every arm still has 5 paired seeds.
serl ablate experiments/study/sokoban_v4.yaml --seeds 5 --out $S/grid-5seeds --parallel "$PARALLEL" -q
serl ablate experiments/study/sokoban_v4.yaml --out $S/grid --reuse $S/grid-5seeds --parallel "$PARALLEL" -q

# 6. the committed summaries, and the report rebuilt from them alone
mkdir -p $K/sft_alone $K/diagnostics
python -c "import json, sys; d = json.load(open(sys.argv[1])); d.pop('by_task', None); json.dump(d, open(sys.argv[2], 'w'), indent=2)" \
    $S/sft-alone/eval.json $K/sft_alone/warm_start.json
cp $S/gate/gate.json $K/gate.json
cp $S/diagnostics/*.json $K/diagnostics/
serl ablate --report $S/grid --keep $K -q   # the cells beside gate.json, sft_alone/, diagnostics/
