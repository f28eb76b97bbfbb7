#!/usr/bin/env bash
# Long GPU work on the device machine across calls: one call is at most 10 minutes, but a process that starts a
# session of its own (setsid) runs on while the machine stays warm (~30 s after each call), so calls made back to
# back can start work, stage more wheels meanwhile, and collect what finished. From the repo root, there:
#   bash bench/device_background.sh start NAME [--after OTHER] 'STEP' 'STEP' ...   # returns at once
#   bash bench/device_background.sh wait SECONDS NAME ...   # until all NAMEs are done or SECONDS passed
# start runs the steps one after another through bench/device_collect.sh (each step's log, $STEP_OUT, the
# files it added under bench/results), after OTHER has finished if given (two GPU benches never overlap).
# wait prints each queue's summary and the running step's last lines, and puts one archive per queue in $OUT
# (NAME.tgz: tar xzf NAME.tgz here); it exits 0 when all are done and every step passed, 1 when a step failed,
# 2 when time ran out first (call it again in the next call), 3 at once when a NAME was never started on this
# machine (it was recycled, or the call that started it never ran). Re-sourcing bench/device_env.sh while a queue
# runs rewrites the packages its processes import: the queue's steps set their own environment.
set -uo pipefail
cd "$(dirname "$0")/.."
root=${ROTA_BG_ROOT:-/tmp/rota-bg}  # the queues' folder (tests set their own)
verb=${1:-}; shift || true
case $verb in
start)
  name=${1:?NAME}; shift
  after=""
  if [ "${1:-}" = --after ]; then after=${2:?--after NAME}; shift 2; fi
  [[ $name =~ ^[A-Za-z0-9_-]{1,40}$ ]] || { echo "device_background: NAME '$name': letters, digits, _ and - only" >&2; exit 2; }
  [ -e "$root/$name" ] && { echo "device_background: $root/$name exists: pick another NAME" >&2; exit 2; }
  mkdir -p "$root/$name/work"
  waiter=""
  [ -n "$after" ] && waiter="while [ ! -e $root/$after/done ]; do sleep 1; done;"
  setsid nohup bash -c "$waiter OUT=$root/$name ROTA_COLLECT_WORK=$root/$name/work bash bench/device_collect.sh \"\$@\";
    echo \$? > $root/$name/done" rota-bg "$@" > "$root/$name/queue.log" 2>&1 < /dev/null &
  echo "device_background: $name started (${#} steps${after:+, after $after}); logs in $root/$name"
  ;;
wait)
  secs=${1:?SECONDS}; shift
  [ $# -gt 0 ] || { echo "device_background: wait SECONDS NAME ..." >&2; exit 2; }
  for n in "$@"; do  # a queue never started here (a recycled machine, a start that failed) is not waited for
    [ -d "$root/$n" ] || { echo "device_background: no queue $n on this machine (recycled, or its start failed):" \
                                "start it again" >&2; exit 3; }
  done
  end=$(( $(date +%s) + secs ))
  while :; do
    pending=0
    for n in "$@"; do [ -e "$root/$n/done" ] || pending=1; done
    [ $pending -eq 0 ] || [ "$(date +%s)" -ge "$end" ] && break
    sleep 2
  done
  rc=0
  for n in "$@"; do
    echo "== $n: $( [ -e "$root/$n/done" ] && echo "done, exit $(cat "$root/$n/done")" || echo running)"
    cat "$root/$n/summary.txt" 2>/dev/null
    last=$(ls "$root/$n/work/steps/"*.log 2>/dev/null | tail -1)
    [ -n "$last" ] && { echo "-- last lines of $last"; tail -n 15 "$last"; }
    [ -n "${OUT:-}" ] && tar czf "$OUT/$n.tgz" -C "$root" --exclude="$n/collected.tgz" "$n" 2>/dev/null
    if [ ! -e "$root/$n/done" ]; then rc=2; elif [ "$(cat "$root/$n/done")" != 0 ] && [ $rc -eq 0 ]; then rc=1; fi
  done
  exit $rc
  ;;
*)
  echo "usage: bash bench/device_background.sh start NAME [--after OTHER] 'STEP' ... | wait SECONDS NAME ..." >&2
  exit 2
  ;;
esac
