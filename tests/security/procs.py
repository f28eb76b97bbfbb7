"""Starting a rota server as an operator does: its own process, ready once its stderr says so."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

ROTA = [sys.executable, "-m", "rota"]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without ROTA_* settings (a test's server gets only what it is given), plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}, **extra}


def serving(argv: list[str], env: dict[str, str] | None = None, ready: str = "serving on"
            ) -> tuple[subprocess.Popen, list[str]]:
    """``rota ARGV`` started and read until a stderr line holds ``ready``; (the process, the lines read so far).
    Its stderr keeps being drained afterwards; stop it with terminate()."""
    proc = subprocess.Popen([*ROTA, *argv], env=clean_env() if env is None else env, stderr=subprocess.PIPE,
                            text=True)
    lines: list[str] = []
    while not lines or ready not in lines[-1]:
        lines.append(proc.stderr.readline())  # type: ignore[union-attr]
        assert lines[-1] or proc.poll() is None, f"rota {' '.join(argv)} exited with {proc.wait()}: {lines}"
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # type: ignore[union-attr]
    return proc, lines


def rota_calls_refused(stub: object, code: object) -> list[str]:
    """An eviction of job ``victim`` of group g, an acquire for ``mallory`` and Status through a RotaService
    ``stub``: each must be refused with grpc ``code``; their details."""
    import grpc
    import pytest

    from rota.wire import rota_v1_pb2 as pb

    details = []
    for call in (lambda: stub.Evict(pb.EvictRequest(job_id="victim", group_id="g"), timeout=5),  # type: ignore
                 lambda: stub.Acquire(pb.TurnRequest(job_id="mallory", group_id="g"), timeout=5),  # type: ignore
                 lambda: stub.Status(pb.StatusRequest(), timeout=5)):  # type: ignore[attr-defined]
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == code, info.value.details()
        details.append(info.value.details() or "")
    return details


def attacker_rpc(as_attacker: object, target: str, stub: str, call: str, prelude: str = "") -> list[str]:
    """Run, as the attacker uid, ``prelude`` then ``stub(grpc.insecure_channel(target)).<call>``; the words it
    printed: what ``prelude`` prints, then "CALLED" or the grpc status code's name."""
    code = f"""
import grpc
from rota.wire import rota_v1_pb2 as pb, rota_v1_pb2_grpc as pb_grpc
from rota.wire import snapshot_agent_pb2 as sa, snapshot_agent_pb2_grpc as sa_grpc
{prelude}
stub = {stub}(grpc.insecure_channel({target!r}))
try:
    stub.{call}
    print("CALLED")
except grpc.RpcError as exc:
    print(exc.code().name)
"""
    done = as_attacker(code, env={"PYTHONPATH": os.pathsep.join(sys.path)})  # type: ignore[operator]
    assert done.returncode == 0, done.stderr
    return done.stdout.split()
