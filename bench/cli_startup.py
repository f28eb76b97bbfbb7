"""How fast the ``rota`` command line answers, as a user runs it (a fresh process each time).

Measured, each ``--runs`` times (median and best wall seconds):

* ``rota --help`` (the command list: every installed plugin's commands);
* ``rota status`` with no orchestrator running (it fails at once, naming the address it tried);
* ``rota status --orchestrator ADDR`` against a served orchestrator (``rota orchestrator serve`` on loopback);
* ``rota status --orchestrator ADDR --timeout T`` against a silent server (a listener that accepts and never
  answers): how long it takes to fail, and whether its error names ADDR.

With ``--baseline PATH`` (another ``rota`` executable, e.g. an older checkout's venv) the same cases run for it
too, alternating run by run, and the JSON has each case's ratio (this / baseline), measured in one run.

    python bench/cli_startup.py --out bench/results/cli-startup.json
    python bench/cli_startup.py --baseline /tmp/old/.venv/bin/rota --out bench/results/cli-startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rota.rpc import free_port
from rota.testing import eventually, silent_listener


def _timed(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    return time.perf_counter() - t0, done.returncode, done.stdout + done.stderr


def _served(rota: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """A served orchestrator on loopback (no auth: the bench's own, on 127.0.0.1)."""
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([rota, "orchestrator", "serve", "--listen", addr, "--insecure"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    eventually(lambda: _timed([rota, "status", "--orchestrator", addr], env)[1] == 0, "the orchestrator serving",
               timeout=60)
    return proc, addr


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rota", default=shutil.which("rota") or os.path.join(os.path.dirname(sys.executable), "rota"),
                    help="the rota executable to measure [default: this venv's]")
    ap.add_argument("--baseline", default="", help="another rota executable, measured alternately for ratios")
    ap.add_argument("--runs", type=int, default=20, help="runs of each case [default: 20]")
    ap.add_argument("--silent-timeout", type=float, default=2.0, help="--timeout of the silent-server case, seconds")
    ap.add_argument("--out", default="", help="write the JSON here")
    args = ap.parse_args()
    tools = {"this": args.rota, **({"baseline": args.baseline} if args.baseline else {})}
    for name, path in tools.items():
        if not os.access(path, os.X_OK):
            ap.error(f"--{'rota' if name == 'this' else 'baseline'} {path!r} is not an executable")
    runtime = tempfile.mkdtemp(prefix="rota-bench-rt-")
    env = {**os.environ, "ROTA_RUNTIME_DIR": runtime}  # no orchestrator on this runtime dir's socket
    env.pop("ROTA_ORCHESTRATOR", None)
    procs = []
    try:
        with silent_listener() as silent:
            served = {}
            for name, path in tools.items():
                proc, addr = _served(path, env)
                procs.append(proc)
                served[name] = addr
            cases = {
                "help": lambda rota, name: [rota, "--help"],
                "status_no_orchestrator": lambda rota, name: [rota, "status"],
                "status_served": lambda rota, name: [rota, "status", "--orchestrator", served[name]],
                "status_silent": lambda rota, name: [rota, "status", "--orchestrator", silent, "--timeout",
                                                     str(args.silent_timeout)],
            }
            times: dict[str, dict[str, list[float]]] = {c: {n: [] for n in tools} for c in cases}
            checks: dict[str, dict[str, object]] = {n: {} for n in tools}
            for _ in range(args.runs):
                for case, build in cases.items():
                    for name, path in tools.items():
                        seconds, rc, output = _timed(build(path, name), env)
                        times[case][name].append(seconds)
                        if case in ("status_no_orchestrator", "status_silent"):
                            addr = silent if case == "status_silent" else runtime
                            checks[name][f"{case}_rc"] = rc
                            checks[name][f"{case}_names_address"] = addr in output
                        elif rc != 0:
                            raise SystemExit(f"{name}: {' '.join(build(path, name))} failed ({rc}): {output[-500:]}")
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
        shutil.rmtree(runtime, ignore_errors=True)
    result: dict[str, object] = {
        "bench": "cli_startup", "host": platform.node(), "cpus": os.cpu_count(), "python": sys.version.split()[0],
        "runs": args.runs, "tools": tools, "silent_timeout_s": args.silent_timeout, "checks": checks, "cases": {},
    }
    for case, by_tool in times.items():
        row = {n: {"median_s": round(statistics.median(v), 4), "best_s": round(min(v), 4)} for n, v in by_tool.items()}
        if "baseline" in row:
            row["ratio_median"] = round(row["this"]["median_s"] / row["baseline"]["median_s"], 3)
        result["cases"][case] = row  # type: ignore[index]
        shown = "  ".join(f"{n} {r['median_s']:.3f}/{r['best_s']:.3f} s" for n, r in row.items() if n in tools)
        ratio = f"  ratio {row['ratio_median']:.2f}x" if "ratio_median" in row else ""
        print(f"{case:24s} median/best: {shown}{ratio}")
    print("checks:", json.dumps(checks))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
