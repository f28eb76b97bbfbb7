"""A holder killed with SIGKILL loses the group within its TTL; the next waiter gets it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import rota
from rota.testing import eventually

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tenant_worker.py")


def test_killed_holder_loses_group_and_waiter_is_served(orchestrator, child_env):
    endpoint, engine = orchestrator
    victim = subprocess.Popen([sys.executable, WORKER, endpoint, "g", "victim", "1", "3600"], env=child_env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().startswith("granted victim")
        waiter = rota.connect(group="g", tenant="waiter", endpoint=endpoint)
        os.kill(victim.pid, signal.SIGKILL)
        t0 = time.monotonic()
        grant = waiter.acquire()
        lost_after = time.monotonic() - t0
        assert grant.job_id == "waiter" and grant.token == 2
        assert lost_after < engine.config.ttl_s + 5  # generous bound: TTL plus scheduling slack
        assert engine.groups["g"].tenants["victim"].state == "lost"
        waiter.close()
    finally:
        victim.kill()
        victim.wait(timeout=10)


def test_hung_holder_loses_group_after_ttl(orchestrator, child_env):
    """SIGSTOP keeps the socket open but stops heartbeats: only the TTL can catch it."""
    endpoint, engine = orchestrator
    victim = subprocess.Popen([sys.executable, WORKER, endpoint, "g", "frozen", "1", "3600"], env=child_env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().startswith("granted frozen")
        os.kill(victim.pid, signal.SIGSTOP)
        waiter = rota.connect(group="g", tenant="waiter", endpoint=endpoint)
        t0 = time.monotonic()
        assert waiter.acquire().job_id == "waiter"
        assert time.monotonic() - t0 >= engine.config.ttl_s * 0.5  # it was the TTL, not a disconnect
        waiter.close()
    finally:
        victim.kill()
        victim.wait(timeout=10)


def test_leaving_waiter_drops_out_of_queue(orchestrator, child_env):
    endpoint, engine = orchestrator
    holder = rota.connect(group="g", tenant="h", endpoint=endpoint)
    holder.acquire()
    quitter = subprocess.Popen([sys.executable, WORKER, endpoint, "g", "quitter", "1", "0"], env=child_env,
                               stdout=subprocess.PIPE, text=True)
    eventually(lambda: engine.groups["g"].queued("quitter") is not None)
    quitter.kill()
    quitter.wait(timeout=10)
    eventually(lambda: engine.groups["g"].queued("quitter") is None)
    info = holder.release()
    assert info.snapshot_deferred  # nobody waits any more
    holder.close()
