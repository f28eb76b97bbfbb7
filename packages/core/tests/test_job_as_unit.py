"""A job of several ranks is one unit: a rank that dies, raises in its turn or fails its
restore ends the whole job's turn at once (the next job is granted), and the other ranks
are told to abort (the ``rota_job_aborted`` hook) and refuse further turns.

Real processes on a real orchestrator over gRPC; the 'collective' the surviving rank
waits in is a plain wait (no torch), the tracked state a 1-byte stand-in (rank_worker.py).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

import rota
from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank_worker.py")
TTL_S = 3.0


@pytest.fixture
def served():
    with running_orchestrator(OrchestratorConfig(ttl_s=TTL_S, park_timeout_s=10.0)) as s:
        yield s


@contextlib.contextmanager
def _job_of_two(endpoint: str, env: dict[str, str], mode: str, ready: str = "") -> Iterator[list[subprocess.Popen]]:
    """Both ranks of job2 running ``mode``; once each printed ``ready`` (if given), yield them; kill them after."""
    ranks = [subprocess.Popen([sys.executable, WORKER, endpoint, "g", "job2", str(r), "2", mode], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for r in range(2)]
    try:
        for p in ranks if ready else ():
            _line(p, ready)
        yield ranks
    finally:
        for p in ranks:
            p.kill()
            p.wait(timeout=10)


def _line(proc: subprocess.Popen, prefix: str) -> str:
    """The next line of ``proc`` that starts with ``prefix`` (others are skipped)."""
    while True:
        line = proc.stdout.readline()
        assert line, f"process exited (code {proc.poll()}) before printing {prefix!r}"
        if line.startswith(prefix):
            return line.strip()


def _lines(proc: subprocess.Popen, *prefixes: str) -> dict[str, str]:
    """prefix -> the first line of ``proc`` starting with it, for every prefix, in whatever order they come."""
    got: dict[str, str] = {}
    while len(got) < len(prefixes):
        line = proc.stdout.readline()
        assert line, f"process exited (code {proc.poll()}) before printing {set(prefixes) - set(got)}"
        for prefix in prefixes:
            if line.startswith(prefix) and prefix not in got:
                got[prefix] = line.strip()
    return got


def test_rank_killed_mid_turn_ends_the_jobs_turn_and_aborts_the_other_rank(served, child_env):
    endpoint, engine = served
    with _job_of_two(endpoint, child_env, "wait", ready="granted") as ranks:
        waiter = rota.connect(group="g", tenant="next", endpoint=endpoint)
        os.kill(ranks[1].pid, signal.SIGKILL)  # dies inside the turn; rank 0 still holds and heartbeats
        t0 = time.monotonic()
        grant = waiter.acquire()
        assert grant.job_id == "next" and time.monotonic() - t0 < TTL_S  # the broken stream, not the TTL
        assert engine.groups["g"].tenants["job2"].state == "lost"
        seen = _lines(ranks[0], "aborted", "refused")  # the hook's thread and the main thread print
        assert "rank 1" in seen["aborted"] and seen["refused"] == "refused Faulted"
        waiter.close()


def test_rank_frozen_mid_turn_ends_the_jobs_turn_within_the_ttl(served, child_env):
    """SIGSTOP keeps rank 1's socket open: only its missing heartbeats show it is gone."""
    endpoint, _engine = served
    with _job_of_two(endpoint, child_env, "wait", ready="granted") as ranks:
        waiter = rota.connect(group="g", tenant="next", endpoint=endpoint)
        os.kill(ranks[1].pid, signal.SIGSTOP)
        t0 = time.monotonic()
        assert waiter.acquire().job_id == "next"
        assert TTL_S * 0.5 <= time.monotonic() - t0 < TTL_S * 3
        assert "heartbeat TTL" in _lines(ranks[0], "aborted")["aborted"]
        waiter.close()


def test_rank_raising_in_its_turn_faults_the_job_as_a_unit(served, child_env):
    endpoint, engine = served
    with _job_of_two(endpoint, child_env, "raise") as ranks:
        waiter = rota.connect(group="g", tenant="next", endpoint=endpoint)
        assert _line(ranks[1], "raised") == "raised"
        assert waiter.acquire().job_id == "next"  # rank 0 never released: the fault ended the turn
        rec = engine.groups["g"].tenants["job2"]
        # FAULTED; "lost" once both processes have exited (the fault's cause stays recorded)
        assert rec.state in ("faulted", "lost") and "loss is NaN" in rec.fault and "rank 1" in rec.fault
        seen = _lines(ranks[0], "aborted", "refused")
        assert "loss is NaN" in seen["aborted"] and seen["refused"] == "refused Faulted"
        assert ranks[1].wait(timeout=30) == 0
        waiter.close()


def test_rank_whose_restore_fails_faults_the_job_and_frees_the_group(served, child_env):
    endpoint, engine = served
    with _job_of_two(endpoint, child_env, "restore", ready="released") as ranks:
        other = rota.connect(group="g", tenant="other", endpoint=endpoint)
        other.pm.register(_OneByte(other))
        with other.turn():  # job2 (1 byte, no capacity known) is parked for it
            assert engine.groups["g"].tenants["job2"].state == "parked"
        for p in ranks:
            p.stdin.write("go\n")
            p.stdin.flush()
        assert _line(ranks[1], "failed") == "failed RuntimeError"  # the restore's own error reaches the caller
        assert "restore failed" in _lines(ranks[0], "aborted")["aborted"]
        assert other.acquire().job_id == "other"
        rec = engine.groups["g"].tenants["job2"]
        assert rec.state in ("faulted", "lost") and "restore failed" in rec.fault
        other.close()


class _OneByte:
    def __init__(self, gpu: rota.Gpu) -> None:
        self.gpu = gpu

    @rota.hookimpl
    def rota_footprint(self, tenant):
        return {"weights": 1} if tenant is self.gpu else None
