#!/usr/bin/env bash
# Study v5 (docs/studies/sokoban_v5.md): SERL's schedule and bounds from study v4's warm start, on CPU.
# It shares v4's recipe for the warm start and gate (runs/study-v4; rebuilt here when absent; where it is v4's by
# content, v4's identical cells are reused and v4's grid is completed), measures the step each arm takes (the learning
# rates of the step-matched arms come from that), the mechanism figures of a first update at every bound, then the
# grid of experiments/study/sokoban_v5.yaml and the rest of v4's grid, PARALLEL cells at a time (one torch thread
# each). Resumable: rerunning skips what is done. The summaries are kept under docs/results/sokoban_v5/ and
# docs/results/sokoban_v4/, and each report is rebuilt from them alone.
set -euo pipefail
cd "$(dirname "$0")/../.."
PARALLEL="${PARALLEL:-2}"
S=runs/study-v4
V=runs/study-v5
K4=docs/results/sokoban_v4
K=docs/results/sokoban_v5
export SERL_THREADS=1

# 1. v4's noisy-expert data, reading-capable warm start and teacher-signal gate (run_study_v4.sh, steps 1-2)
[ -f $S/expert/rollouts.jsonl ] || serl rollout --config experiments/sokoban/expert.yaml --out $S/expert --threads 1 -q
[ -d $S/expert_reading ] || cp -r $S/expert $S/expert_reading
[ -f $S/warm_start/config.json ] || serl train $S/expert_reading --config experiments/sokoban/warm_start_reading.yaml \
    --out $S/warm_start --threads 1 -q --overwrite
SAME_AS_V4=$(python - $S/warm_start $K4/cells/grpo-s0/cell.json <<'PY'
import json, sys
from serl_cli.ablate.cells import start_model_identity
here, v4 = start_model_identity(sys.argv[1]), json.load(open(sys.argv[2]))["start_model"]
print("yes" if here == v4 else "no")
print(f"warm start {here}, study v4's {v4}", file=sys.stderr)
PY
)
[ -f $S/gate/gate.json ] || python experiments/sokoban/teacher_gate.py --model $S/warm_start --seen $S/expert \
    --out $S/gate > /dev/null || true
python -c "import json, sys; g = json.load(open(sys.argv[1]))['gate']; sys.exit(0 if g['met'] else f'gate not met: {g}')" \
    $S/gate/gate.json
mkdir -p $K/diagnostics $K/sft_alone $V
# SFT alone on the panel, as every cell's final evaluation decodes (T 0.4, seed 0)
[ -f $V/sft-alone/eval.json ] || serl eval --config experiments/sokoban/study_v4.yaml --model $S/warm_start \
    --seed 0 --out $V/sft-alone --threads 1 -q
python -c "import json, sys; d = json.load(open(sys.argv[1])); d.pop('by_task', None); json.dump(d, open(sys.argv[2], 'w'), indent=2)" \
    $V/sft-alone/eval.json $K/sft_alone/warm_start.json

# 2. the step each arm takes: GRPO and SERL-oracle at loose bounds, seed 0, 10 iterations, every checkpoint kept.
#    The step-matched arms' learning rates are 1e-4 scaled by the ratio of the mean steps (sokoban_v5.yaml).
PROBE="--config experiments/sokoban/study_v4.yaml --model $S/warm_start --seed 0 --iterations 10 --threads 1 -q
       --set keep_last=0 --set eval.episodes=0"
LOOSE="--set train.algo=serl --set annotate.weight_clip=1.0 --set annotate.mixing_lambda=1.0 --set annotate.lambda_decay_steps=0"
[ -f $V/probe/grpo/iter_0009/checkpoint/model.safetensors ] || serl train $PROBE --out $V/probe/grpo --overwrite
# shellcheck disable=SC2086
[ -f $V/probe/serl-oracle-loose/iter_0009/checkpoint/model.safetensors ] || serl train $PROBE $LOOSE \
    --out $V/probe/serl-oracle-loose --overwrite
python experiments/sokoban/update_norms.py --start $S/warm_start $V/probe/grpo $V/probe/serl-oracle-loose \
    > $K/update_norms.json

# 3. the mechanism figures of a first update on the gate's panel, at each arm's bounds
for bounds in "authors expert 0.2 0.5" "middle expert 0.5 0.5" "loose expert 1.0 1.0" "ref-middle ref 0.5 0.5"; do
    set -- $bounds
    [ -f $K/diagnostics/$1.json ] || python experiments/sokoban/update_diagnostics.py $S/gate/panel \
        --model $S/warm_start --sources $2 --weight-clip $3 --mixing-lambda $4 > $K/diagnostics/$1.json
done

# 4. the grid, arm by arm in the file's order (v4's identical cells copied where the warm start is v4's by content, and
#    this study's kept cells where it is this study's: a rebuilt machine resumes from the summaries)
serl ablate experiments/study/sokoban_v5.yaml --out $V/grid --reuse $K4 --reuse $K --parallel "$PARALLEL" -q
serl ablate --report $V/grid --keep $K -q

# 5. v4's grid completed (seeds 5-9 of SERL-ref, SERL-error,diff and SDPO): only from v4's own warm start, since
#    its finished cells are paired with the new ones by that start; from any other start, v4's whole grid again
if [ "$SAME_AS_V4" = yes ]; then
    serl ablate experiments/study/sokoban_v4.yaml --out $S/grid --reuse $K4 --parallel "$PARALLEL" -q
    serl ablate --report $S/grid --keep $K4 -q
else
    # v4's start cannot be rebuilt (docs/studies/sokoban_v5.md), so v4's grid is run whole from this one: its
    # GRPO and two SERL-oracle arms are this study's cells (the same cells, reused), the other four arms new.
    # Kept apart from v4's own cells, which pair only with each other.
    KEPT=(--reuse $K)
    [ -d $K4/rebuilt_start ] && KEPT+=(--reuse $K4/rebuilt_start)  # a rebuilt machine resumes from the summaries
    serl ablate experiments/study/sokoban_v4.yaml --out $S/grid-rebuilt "${KEPT[@]}" --parallel "$PARALLEL" -q
    serl ablate --report $S/grid-rebuilt --keep $K4/rebuilt_start -q
fi
