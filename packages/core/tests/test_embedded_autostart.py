"""With nothing configured, `rota.connect()` starts (or finds) one embedded orchestrator
per host on a Unix socket; concurrent first clients start exactly one; `rota status`
reads it; it exits by itself when idle."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

TENANT = """
import sys, time, rota
gpu = rota.connect(group="auto", tenant=sys.argv[1])
for _ in range(3):
    with gpu.turn() as grant:
        print(grant.token, flush=True)
        time.sleep(0.05)
gpu.close()
"""


def _orchestrator_pids(runtime: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", "--", f"--listen unix:{runtime}/orchestrator.sock"], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def test_first_clients_start_exactly_one_orchestrator(child_env, tmp_path):
    runtime = child_env["ROTA_RUNTIME_DIR"]
    procs = [subprocess.Popen([sys.executable, "-c", TENANT, f"t{i}"], env=child_env, stdout=subprocess.PIPE, text=True)
             for i in range(3)]
    tokens = []
    for p in procs:
        out, _ = p.communicate(timeout=120)
        assert p.returncode == 0
        tokens += [int(t) for t in out.split()]
    assert sorted(tokens) == list(range(1, 10))  # 9 turns, one token each, none shared
    pids = _orchestrator_pids(runtime)
    assert len(pids) == 1, pids
    status = subprocess.run([sys.executable, "-m", "rota", "status", "auto", "--json"], env=child_env,
                            capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    (group,) = json.loads(status.stdout)["groups"]
    assert group["group_id"] == "auto" and [t["turns"] for t in group["tenants"]] == [3, 3, 3]
    os.kill(pids[0], 15)


def test_status_without_orchestrator_says_how_to_fix(child_env):
    r = subprocess.run([sys.executable, "-m", "rota", "status"], env=child_env, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1
    assert "no orchestrator is running" in r.stderr and "ROTA_ORCHESTRATOR" in r.stderr


def test_embedded_orchestrator_exits_when_idle(child_env):
    runtime = child_env["ROTA_RUNTIME_DIR"]
    server = subprocess.Popen([sys.executable, "-m", "rota", "orchestrator", "serve", "--listen",
                               f"unix:{runtime}/orchestrator.sock", "--idle-exit", "1"], env=child_env,
                              stderr=subprocess.PIPE, text=True)
    os.makedirs(runtime, mode=0o700, exist_ok=True)  # a served socket's folder must be 0700
    try:
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
    deadline = time.monotonic() + 5
    while _orchestrator_pids(runtime) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _orchestrator_pids(runtime)
