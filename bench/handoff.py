"""Handoff latency: N tenant processes ping-pong one group with their state resident.

Handoff = time from holder A calling release() to the next holder B's acquire()
returning (both on this host's monotonic clock). Prints p50/p99 and writes JSON.

    python bench/handoff.py [--procs 4] [--turns 300] [--orchestrator HOST:PORT] [--out FILE]
    python bench/handoff.py --etcd [URL]      # through etcd (rota-orchestrator-etcd)

Without --orchestrator it starts an embedded one (`rota orchestrator serve`) on a free
loopback port for the run. With --etcd it serves `rota orchestrator serve --etcd URL`
instead, starting a one-member etcd on loopback when no URL is given.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import subprocess
import sys
import time

from rota._units import percentile
from rota.testing import free_port


def tenant(endpoint: str, group: str, job: str, turns: int, start_at: float) -> None:
    import rota

    gpu = rota.connect(group=group, tenant=job, endpoint=endpoint)
    while time.monotonic() < start_at:
        time.sleep(0.001)
    for _ in range(turns):
        grant = gpu.acquire()
        granted = time.monotonic()
        released = time.monotonic()
        gpu.release()
        print(f"{grant.token} {granted:.9f} {released:.9f}", flush=True)
    gpu.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--procs", type=int, default=4, help="tenant processes (default 4)")
    ap.add_argument("--turns", type=int, default=300, help="turns per process (default 300)")
    ap.add_argument("--orchestrator", default="", help="use this orchestrator instead of starting one")
    ap.add_argument("--label", default="embedded", help="name of this configuration in the JSON")
    ap.add_argument("--etcd", nargs="?", const="local", default="",
                    help="keep state in etcd at URL (default: start a one-member etcd on loopback)")
    ap.add_argument("--out", default="", help="JSON output path (default bench/results/handoff[-etcd]-cpu.json)")
    ap.add_argument("--_tenant", nargs=5, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns._tenant:
        endpoint, group, job, turns, start = ns._tenant
        tenant(endpoint, group, job, int(turns), float(start))
        return
    if ns.procs < 2 or ns.turns < 1:
        ap.error("--procs must be >= 2 and --turns >= 1")
    if ns.etcd and ns.label == "embedded":
        ns.label = "etcd"
    ns.out = ns.out or f"bench/results/handoff{'-etcd' if ns.etcd else ''}-cpu.json"
    server = etcd = None
    endpoint = ns.orchestrator
    if not endpoint:
        endpoint = f"127.0.0.1:{free_port()}"
        args = [sys.executable, "-m", "rota", "orchestrator", "serve", "--listen", endpoint]
        if ns.etcd == "local":
            import tempfile

            from rota_etcd.testing import EtcdCluster

            etcd = EtcdCluster(tempfile.mkdtemp(prefix="rota-handoff-etcd-")).start()
            args += ["--etcd", etcd.url]
        elif ns.etcd:
            args += ["--etcd", ns.etcd]
        server = subprocess.Popen(args, stderr=subprocess.DEVNULL)
        from rota._tenant.local import is_serving

        deadline = time.monotonic() + 20
        while not is_serving(endpoint, 0.5):
            if time.monotonic() > deadline:
                sys.exit(f"orchestrator did not start on {endpoint}")
    group = f"handoff-{os.getpid()}"
    start_at = time.monotonic() + 2.0
    print(f"handoff: {ns.procs} processes x {ns.turns} turns on {endpoint} ...", file=sys.stderr)
    procs = [subprocess.Popen([sys.executable, __file__, "--_tenant", endpoint, group, f"t{i}", str(ns.turns),
                               str(start_at)], stdout=subprocess.PIPE, text=True) for i in range(ns.procs)]
    rows = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                sys.exit(f"a tenant process failed with exit code {p.returncode}")
            rows += [tuple(float(x) for x in line.split()) for line in out.splitlines() if line.strip()]
    finally:
        if server is not None:
            server.terminate()
            server.wait(10)
        if etcd is not None:
            etcd.stop()
    rows.sort()
    tokens = [int(r[0]) for r in rows]
    assert tokens == sorted(set(tokens)), "two grants with one token"
    for prev, nxt in itertools.pairwise(rows):
        assert nxt[1] >= prev[2], "a grant before the previous holder released"  # no overlapping turns
    handoffs = [(nxt[1] - prev[2]) * 1000 for prev, nxt in itertools.pairwise(rows)]
    result = {
        "benchmark": "handoff", "label": ns.label, "procs": ns.procs, "turns": len(rows),
        "machine": f"{platform.node()} {os.cpu_count()} cpu", "python": platform.python_version(),
        "p50_ms": percentile(handoffs, 50), "p90_ms": percentile(handoffs, 90), "p99_ms": percentile(handoffs, 99),
        "target_p50_ms": 2.0 if ns.label == "embedded" else 10.0,
    }
    result["p50_over_target"] = result["p50_ms"] / result["target_p50_ms"]
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"handoff {ns.label}: p50 {result['p50_ms']:.2f} ms  p90 {result['p90_ms']:.2f} ms  "
          f"p99 {result['p99_ms']:.2f} ms  over {len(handoffs)} handoffs; p50 / target "
          f"{result['p50_over_target']:.2f}  -> {ns.out}")


if __name__ == "__main__":
    main()
