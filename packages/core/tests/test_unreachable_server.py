"""A client command against an orchestrator that is down or silent fails within its timeout with one line
naming the address and the setting to change (ROTA_CONNECT_TIMEOUT_S, --timeout).

Real parts: `rota status` processes against a real TCP listener that accepts and never answers
(rota.testing.silent_listener) and against a port nobody listens on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rota.testing import free_port, silent_listener


def _rota(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rota", *args], capture_output=True, text=True, timeout=120,
                         env={**base, **(env or {})})
    return out, time.monotonic() - t0


@pytest.mark.parametrize("how", ["env", "flag"])
def test_status_against_a_silent_orchestrator_is_one_line_within_its_timeout(how):
    with silent_listener() as address:
        if how == "env":
            out, took = _rota("status", "--orchestrator", address, env={"ROTA_CONNECT_TIMEOUT_S": "1.5"})
        else:
            out, took = _rota("status", "--orchestrator", address, "--timeout", "1.5")
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert address in lines[0] and "1.5 s" in lines[0] and "--timeout" in lines[0]
    assert "ROTA_CONNECT_TIMEOUT_S" in lines[0]
    assert 1.4 < took < 30  # waited its timeout (not the 41 s of retries, nor a fixed 12 s), then stopped


def test_status_against_a_refused_port_is_one_line_naming_the_address():
    address = f"127.0.0.1:{free_port()}"
    out, _ = _rota("status", "--orchestrator", address, "--timeout", "20")
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert lines[0].startswith(f"Error: cannot reach the orchestrator at {address} (")
    assert "ROTA_ORCHESTRATOR" in lines[0]


def test_a_bad_timeout_is_refused_naming_it():
    out, _ = _rota("status", "--orchestrator", "127.0.0.1:1", env={"ROTA_CONNECT_TIMEOUT_S": "soon"})
    assert out.returncode == 1 and "ROTA_CONNECT_TIMEOUT_S='soon' is not a number" in out.stderr
    out, _ = _rota("status", "--orchestrator", "127.0.0.1:1", "--timeout", "0")
    assert out.returncode == 2 and "--timeout" in out.stderr
