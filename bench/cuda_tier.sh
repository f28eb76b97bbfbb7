#!/usr/bin/env bash
# The CUDA test tier, on a GPU machine (one H200 runs it in a few minutes), from the repo root:
#   bash bench/cuda_tier.sh [PYTEST ARGS]
# On the device machine (no PyPI) it installs rota from the checkout through bench/device_env.sh (carry .whl);
# elsewhere it uses ./dev's .venv (CUDA torch must be installed there). Writes the figures, each test's outcome,
# the commit and the date to bench/results/cuda-tier-<UTC date>.json (and to $OUT when the device tool sets it).
# The device tool's copy of the tree may carry an older .git: there, pass the commit that runs,
#   ROTA_COMMIT=$(git rev-parse HEAD) bash bench/cuda_tier.sh   (the command line is made here, so HEAD is ours)
# Its two parts: ROTA_TIER_PART=core (the park path: rota_torch, the adapters, the agent, devices, LoRA, the toy
# demo, Tinker; meant to take at most 10 minutes on one H200) and ROTA_TIER_PART=engines (vLLM, SGLang, TRL and
# the demo's vLLM runs: tests marked `engines`, which need the staged engines); unset, both.
# Any other part of it: ROTA_TIER_TESTS="tests/cuda/test_demo_cuda.py ..." (default tests/cuda);
# ROTA_TIER_NAME=part1 names its JSON cuda-tier-<date>-part1.json (default: the part's name, if one is set).
set -euo pipefail
cd "$(dirname "$0")/.."
case ${ROTA_TIER_PART:=} in
  "") marks=cuda ;;
  core) marks="cuda and not engines" ;;
  engines) marks="cuda and engines" ;;
  *) echo "cuda_tier: ROTA_TIER_PART='$ROTA_TIER_PART' is not a part of the tier: core, engines, or unset for both" >&2
     exit 2 ;;
esac
if [ -d .whl ]; then
  source bench/device_env.sh
  PY=python3
else
  PY=.venv/bin/python
fi
export ROTA_TIER_PART
: "${ROTA_TIER_NAME:=$ROTA_TIER_PART}"
stamp=$(date -u +%Y%m%dT%H%M%SZ)
mkdir -p bench/results
json=bench/results/cuda-tier-$stamp${ROTA_TIER_NAME:+-$ROTA_TIER_NAME}.json
export ROTA_CUDA_TIER_JSON=$PWD/$json
export ROTA_COMMIT=${ROTA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}
set +e
log=bench/results/cuda-tier-$stamp${ROTA_TIER_NAME:+-$ROTA_TIER_NAME}.log
# shellcheck disable=SC2086  # a list of test paths
$PY -m pytest ${ROTA_TIER_TESTS:-tests/cuda} -m "$marks" -p no:cacheprovider -ra "$@" 2>&1 | tee "$log" ${OUT:+"$OUT/$(basename "$log")"} | grep -E "passed|failed|PASSED|FAILED|ERROR|Error|park" \
  | grep -v "warnings.warn" | tail -40
rc=${PIPESTATUS[0]}
set -e
[ -n "${OUT:-}" ] && [ -f "$json" ] && cp "$json" "$OUT/"
echo "cuda tier: exit $rc, figures in $json"
exit $rc
