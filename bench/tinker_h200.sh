#!/usr/bin/env bash
# The Tinker service's H200 figures, in stages that each fit one device call (run from the repo root):
#   bash bench/tinker_h200.sh smoke    # tiny Qwen3 shape on CUDA through both benches (about a minute)
#   bash bench/tinker_h200.sh full     # three full-parameter tenants, 0.6B/1.7B/4B shapes, taking turns
#   bash bench/tinker_h200.sh density  # LoRA density on a Qwen3-1.7B-shaped base, think 4x and 8x the step
#   bash bench/tinker_h200.sh last     # the full tenants with 3 steps, and N = 8 at think 4x
#   bash bench/tinker_h200.sh shared   # LoRA density with shared LoRA turns (--lora-concurrency 4), think 4x
#   bash bench/tinker_h200.sh multilora  # one batched LoRA step of N = 1..64 tenants (rota_tinker._worker.multilora)
#   bash bench/tinker_h200.sh batch    # issue 29's density: --lora-batch at N = 1, 8, 16, 32, 48, 64, think 4x the step
#                                      # (8,192-token micro-batches; -micro8192.json: the earlier runs' files are cited)
#   bash bench/tinker_h200.sh compare  # shared LoRA turns (--lora-concurrency 4) at N = 1, 8, 16, 32 with the think
#                                      # seconds of the batch stage's JSON in bench/results (commit it first: a fresh
#                                      # device machine has only the tree), the two modes under the same load
# JSON and logs go to bench/results/ and, when the device tool sets it, to $OUT as well.
set -euo pipefail
stage=${1:?usage: bash bench/tinker_h200.sh smoke|full|density|last|shared|multilora|batch|compare}
source bench/device_env.sh
results=bench/results
out=${OUT:-$results}
mkdir -p "$results" "$out"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader
run() {  # run NAME CMD...: the command's JSON and log land in bench/results and $OUT
  local name=$1; shift
  echo "== $name: $*"
  local rc=0
  "$@" --out "$results/$name.json" > "$out/$name.log" 2>&1 || rc=$?
  tail -5 "$out/$name.log"
  [ -f "$results/$name.json" ] && [ "$out" != "$results" ] && cp "$results/$name.json" "$out/"
  echo "== $name rc=$rc"
  return $rc
}
case $stage in
  smoke)
    run tinker-density-h200-smoke python3 bench/tinker_density.py --device cuda:0 --model qwen3-tiny --batch 2 \
        --seq-len 16 --tenants 1,2 --steps 3 --warmup 1 --point-timeout-s 120
    run tinker-full-turns-h200-smoke python3 bench/tinker_full_turns.py --device cuda:0 \
        --shapes qwen3-tiny,qwen3-tiny --steps 2 --batch 2 --seq-len 16 ;;
  full)
    run tinker-full-turns-h200 timeout 540 python3 bench/tinker_full_turns.py --device cuda:0 \
        --shapes qwen3-0.6b,qwen3-1.7b,qwen3-4b --steps 4 ;;
  density)
    run tinker-density-h200-qwen3-1.7b timeout 300 python3 bench/tinker_density.py --device cuda:0 \
        --model qwen3-1.7b --tenants 1,2,4,5,6,8 --steps 12 --point-timeout-s 120 || true
    run tinker-density-h200-qwen3-1.7b-r8 timeout 250 python3 bench/tinker_density.py --device cuda:0 \
        --model qwen3-1.7b --tenants 1,6,8,10 --think-ratio 8 --steps 10 --point-timeout-s 100 ;;
  last)  # what the first two stages' time limits cut: the full tenants, then N = 8 at think 4x
    run tinker-full-turns-h200 timeout 270 python3 bench/tinker_full_turns.py --device cuda:0 \
        --shapes qwen3-0.6b,qwen3-1.7b,qwen3-4b --steps 3 || true
    run tinker-density-h200-qwen3-1.7b-n8 timeout 185 python3 bench/tinker_density.py --device cuda:0 \
        --model qwen3-1.7b --tenants 1,8 --steps 8 --point-timeout-s 110 ;;
  shared)  # shared LoRA turns: up to 4 tenants' units at once in one rota turn of the shared base, think 4x the step
    run tinker-density-h200-qwen3-1.7b-shared timeout 560 python3 bench/tinker_density.py --device cuda:0 \
        --model qwen3-1.7b --tenants 1,8,10,12 --steps 10 --lora-concurrency 4 --point-timeout-s 150 ;;
  multilora)  # the device's side of issue 29: batched steps of N tenants on a from_pretrained Qwen3-1.7B snapshot
    run multilora-step-h200-qwen3-1.7b timeout 500 python3 bench/multilora_step.py --device cuda:0 \
        --model qwen3-1.7b --tenants 1,8,16,32,48,64 --steps 5 ;;
  batch)  # every tenant's LoRA in one batched worker; a point that runs past 100 s is recorded as failed
    run tinker-density-h200-qwen3-1.7b-batch-micro8192 timeout 570 python3 bench/tinker_density.py --device cuda:0 \
        --model qwen3-1.7b --tenants 1,8,16,32,48,64 --steps 5 --warmup 1 --lora-batch --point-timeout-s 100 ;;
  compare)  # the shared turns at the batch's points and think seconds (the same load, another service mode)
    think=$(python3 -c "import json; print(json.load(open('$results/tinker-density-h200-qwen3-1.7b-batch-micro8192.json'))['think_s'])")
    run tinker-density-h200-qwen3-1.7b-batch-vs-shared timeout 570 python3 bench/tinker_density.py --device cuda:0 \
        --model qwen3-1.7b --tenants 1,8,16,32 --steps 5 --warmup 1 --lora-concurrency 4 --think-s "$think" \
        --point-timeout-s 110 ;;
  *) echo "unknown stage $stage: use smoke, full, density, last, shared, multilora, batch or compare" >&2; exit 2 ;;
esac
