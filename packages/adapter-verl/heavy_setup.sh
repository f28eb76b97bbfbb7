#!/usr/bin/env bash
# Heavy test tier of rota-adapter-verl: verl 0.9.1 with its pins, on CPU, in a SEPARATE venv (verl pins
# transformers<5.11; rota's main .venv has a newer one for TRL and the Tinker service).
#
#   packages/adapter-verl/heavy_setup.sh              # create/refresh the venv, run the verl tests
#   ROTA_VERL_VENV=/path packages/adapter-verl/heavy_setup.sh --setup-only
#
# Measured on the 2-core machine (shared, loaded): a fresh install took 177 s and 1.9 GB (verl 0.9.1,
# ray 2.60, transformers 5.10.4, tensordict 0.10.0, TransferQueue 0.1.11, torch 2.13.0 CPU); the tests
# about a minute (Ray's start and verl's imports are most of it). verl's own GPU extras (torch==2.11.0
# with CUDA, vllm, flash-attn, megatron) are not installed: on CPU no verl step runs end to end.
# cachetools, pyzmq, msgspec, fastapi and uvicorn come from verl's verl-core extra (its trainer and
# rollout modules import them); the rest of that extra (torchcodec, nvtx, qwen_vl_utils, mathruler) is for
# GPU jobs. The venv is reused while its stamp matches these pins and the pyproject files of the packages
# installed into it.
#
# Environment:
#   ROTA_VERL_VENV   venv folder (default /tmp/rota-verl-venv)
#   PYTHON           interpreter that creates it (default python3; verl needs Python 3.10-3.12)
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
VENV=${ROTA_VERL_VENV:-/tmp/rota-verl-venv}
PY=${PYTHON:-python3}
PINS="verl==0.9.1 torch==2.13.0 TransferQueue==0.1.11 cachetools pyzmq msgspec fastapi uvicorn"
STAMP="$VENV/.rota-heavy"
# the checkout too: its packages are installed editable from it (a venv another clone made points there)
want="$PINS $(cat packages/core/pyproject.toml packages/torch/pyproject.toml packages/adapter-verl/pyproject.toml | sha256sum | cut -c1-16) $ROOT"

if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  echo "heavy_setup: installing $PINS into $VENV (about 3 minutes, 2 GB)" >&2
  start=$(date +%s)
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  timeout 1200 "$VENV/bin/python" -m pip install -q $PINS pytest pytest-timeout \
    -e packages/core -e packages/torch -e "packages/adapter-verl[verl]"
  timeout 300 "$VENV/bin/python" -c "import verl, rota_verl; print('verl', verl.__version__)"
  echo "heavy_setup: verl venv ready in $(( $(date +%s) - start )) s" >&2
  echo "$want" > "$STAMP"
fi
[ "${1:-}" = "--setup-only" ] && exit 0
export HF_HUB_OFFLINE=1 RAY_USAGE_STATS_ENABLED=0
exec timeout 900 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$ROOT/packages/adapter-verl/tests" \
  -o addopts="-ra --timeout=600" "$@"
