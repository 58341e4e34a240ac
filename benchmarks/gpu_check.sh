#!/usr/bin/env bash
# The KV benchmark (benchmarks/engine_kv.py) on one GPU with CUDA vLLM, LMCache beside it.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]        # under 10 minutes on one GPU
#
# Uses the Python in $VENV (default .venv-gpu) when it already imports vllm and lmcache;
# otherwise creates it and installs the project with its `gpu` extra (CUDA vLLM + LMCache:
# needs the package registries). Side by side in one run, on the same tiny dummy-weight
# model as the CPU benchmark: vLLM prefix caching alone, WA-LRU+TTL, Nalar, the full
# dask-agents policy (in-process engines with the project's own host tier), LMCache
# (AsyncLLM with LMCache's CPU tier, workflow-blind), and vLLM's own host tier (AsyncLLM with
# its OffloadingConnector) evicting by vLLM's LRU or by our policy (offload_lru, offload_ours).
# Writes OUT_DIR/engine-kv-gpu.json.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results}
VENV=${VENV:-.venv-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
if ! "$VENV/bin/python" -c "import vllm, lmcache" 2>/dev/null; then
    python3.11 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e ".[gpu]"
fi
"$VENV/bin/python" -c "import torch, vllm; assert torch.cuda.is_available(), 'no CUDA device'; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
# the in-process variants step the engine in this process; the lmcache variant's AsyncLLM
# starts its core in a child process (this script's process is not daemonic)
# the excess family (issue 29's): the floor, LRU with a host tier, ours, LMCache, and vLLM's own
# host tier evicting by LRU or by our policy; one round to fit the device time
timeout 540 "$VENV/bin/python" benchmarks/engine_kv.py --quick --families excess --rounds 1 \
    --variants unbounded lru_host ours lmcache offload_lru offload_ours --json "$OUT/engine-kv-gpu.json"
