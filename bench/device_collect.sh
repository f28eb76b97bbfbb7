#!/usr/bin/env bash
# Run commands on the device machine and bring back everything they wrote as ONE archive.
# Why: the device tool returns at most 8 files from $OUT (2 folders deep), so a demo's demo.json and plot, or a
# tier's JSON beside its log, were left behind when a call ran several of them. This keeps each step's output and
# every file added or changed under bench/results during the call, in $OUT/collected.tgz (steps/NN.log,
# steps/NN/..., results/bench/results/...; here: tar xzf collected.tgz --strip-components=1 -C . results/bench).
#   bash bench/device_collect.sh 'rota demo --device cuda --state 4GB --out-dir $STEP_OUT' 'bash bench/cuda_tier.sh'
# Each argument is one step, run with bash -c in the repo root, its stdout+stderr in steps/NN.log, and
# $STEP_OUT set to a folder of its own (steps/NN/) for what it writes. A failing step does not stop the
# others; the exit status is the first failing step's. $OUT/summary.txt lists each step's status and seconds.
# Each device call copies the working tree again, which deletes files a step added under bench/results and puts
# back the committed version of those it rewrote: what a step wrote there is kept after it ends, but a step that
# runs across two calls should write to $STEP_OUT (e.g. `bench/switch.py --out $STEP_OUT/switch-cuda.json`).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:?run this on the device machine, where the device tool sets OUT}
work=${ROTA_COLLECT_WORK:-$(mktemp -d /tmp/rota-collect.XXXX)}  # bench/device_background.sh names it
mkdir -p "$work/steps" "$work/results" bench/results
touch "$work/.start"
rc=0 n=0
for step in "$@"; do
  n=$((n + 1)); id=$(printf '%02d' "$n")
  mkdir -p "$work/steps/$id"
  t0=$(date +%s)
  STEP_OUT="$work/steps/$id" bash -c "$step" > "$work/steps/$id.log" 2>&1
  s=$?
  [ $s -ne 0 ] && [ $rc -eq 0 ] && rc=$s
  printf '%s exit %d in %ds: %s\n' "$id" "$s" "$(( $(date +%s) - t0 ))" "$step" | tee -a "$out/summary.txt"
  # what the step wrote under bench/results, kept now: the device tool copies the working tree again at every
  # call, which puts back the older committed version of a file a step rewrote (its mtime before .start)
  find bench/results -type f -newer "$work/.start" -exec cp --parents {} "$work/results/" \;
  tar czf "$out/collected.tgz" -C "$work" steps results 2>/dev/null  # after every step: a cut-off call keeps the rest
done
tar czf "$out/collected.tgz" -C "$work" steps results
ls -la "$out/collected.tgz" | tee -a "$out/summary.txt"
exit $rc
