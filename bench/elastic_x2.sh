#!/usr/bin/env bash
# Issue 32, item 3 (and the CUDA tier's device tests), in stages that each fit one device call of 10 minutes:
#   bash bench/elastic_x2.sh smoke   # ONE GPU: tests/cuda/test_devices_cuda.py (its two-GPU tests skip), then
#                                    # bench/elastic_x2.py --smoke: fixed groups, the elastic group (one lane)
#                                    # and dedicated, tiny models, end to end (about 3 minutes)
#   bash bench/elastic_x2.sh 20GB    # nvidia-h200-x2: the device tests, the move bench, then 3 jobs x (trainer +
#                                    # sampler) of 20 GB trainers: dedicated/serial, fixed groups, elastic group
#   bash bench/elastic_x2.sh 60GB    # nvidia-h200-x2: the same with 60 GB trainers (fewer steps: one call)
# JSON, logs and timeline PNGs go to bench/results/ and, when the device tool sets it, to $OUT as well.
set -euo pipefail
stage=${1:?usage: bash bench/elastic_x2.sh smoke|20GB|60GB}
source bench/device_env.sh
results=bench/results
out=${OUT:-$results}
mkdir -p "$results" "$out"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
nvidia-smi topo -m 2>/dev/null | head -4 || true
date=$(date -u +%Y%m%dT%H%M%SZ)
export ROTA_COMMIT=${ROTA_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}  # into every JSON
copy() { for f in "$@"; do [ -f "$f" ] && [ "$out" != "$results" ] && cp "$f" "$out/"; done; return 0; }
tier() {  # the device tests of issue 32 (one GPU: the one-GPU test; two: all three)
  local name=cuda-tier-devices-$1-$date rc=0
  ROTA_CUDA_TIER_JSON=$results/$name.json timeout ${2:-150} python3 -m pytest -q -p no:cacheprovider \
      tests/cuda/test_devices_cuda.py -rs > "$out/$name.log" 2>&1 || rc=$?
  tail -8 "$out/$name.log"; copy "$results/$name.json"; echo "== device tests rc=$rc"
}
bench() {  # bench NAME TIMEOUT ARGS...: bench/elastic_x2.py, its JSON and PNGs to bench/results and $OUT
  local name=$1 limit=$2 rc=0; shift 2
  echo "== $name: $*"
  timeout "$limit" python3 bench/elastic_x2.py --out "$results/$name.json" "$@" > "$out/$name.log" 2>&1 || rc=$?
  tail -12 "$out/$name.log"
  copy "$results/$name.json" "$results/$name-fixed-timeline.png" "$results/$name-elastic-timeline.png"
  echo "== $name rc=$rc"
  return $rc
}
case $stage in
  smoke)
    tier smoke 150
    bench elastic-smoke-1gpu-$date 300 --smoke --steps 4 --capacity 100GB ;;
  20GB)
    tier x2 120
    bench elastic-x2-20GB-$date 420 --state 20GB --steps 40 --capacity 130GB ;;
  60GB)
    bench elastic-x2-60GB-$date 560 --state 60GB --steps 20 --capacity 130GB --resident-first 120 \
        --host-memory 260GB ;;
  *) echo "unknown stage $stage: use smoke, 20GB or 60GB" >&2; exit 2 ;;
esac
