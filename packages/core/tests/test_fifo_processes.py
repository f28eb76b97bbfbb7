"""Three tenant processes contend for one group over real gRPC and get turns in FIFO order."""

from __future__ import annotations

import os
import subprocess
import sys

import rota
from rota.testing import eventually

WORKER = os.path.join(os.path.dirname(__file__), "tenant_worker.py")


def test_three_processes_served_in_arrival_order(orchestrator, child_env):
    endpoint, engine = orchestrator
    holder = rota.connect(group="g", tenant="holder", endpoint=endpoint)
    holder.acquire()  # hold the group so the three children queue behind it
    procs = []
    for name in ("first", "second", "third"):
        procs.append(subprocess.Popen([sys.executable, WORKER, endpoint, "g", name, "1", "0.05"], env=child_env,
                                      stdout=subprocess.PIPE, text=True))
        eventually(lambda n=name: n in [w.job_id for w in engine.groups["g"].queue])
    holder.release()
    lines = []
    for p in procs:
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        lines += out.split()
    events = sorted((float(t), ev, job, int(tok)) for ev, job, tok, t in zip(*[iter(lines)] * 4, strict=True))
    granted = [job for _, ev, job, _ in events if ev == "granted"]
    assert granted == ["first", "second", "third"]
    tokens = [tok for _, ev, _, tok in events if ev == "granted"]
    assert tokens == sorted(tokens) and len(set(tokens)) == 3
    # turns never overlap: each grant comes after the previous release
    spans = [(t, ev) for t, ev, _, _ in events]
    assert [ev for _, ev in spans] == ["granted", "released"] * 3
    holder.close()
