"""`kubectl rota` / `rota k8s` against an API server or orchestrator that is down or silent: one line naming the
address and the settings (ROTA_CONNECT_TIMEOUT_S, --timeout), within the timeout, no urllib3 traceback.

Real parts: the installed `kubectl-rota` and `rota` executables in their own processes, a kubeconfig whose
server is a real TCP listener that accepts and never answers (rota.testing.silent_listener), or a port nobody
listens on.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from k8s_fake_portforward import FakePortForwardApi, kubeconfig

from rota.testing import free_port, silent_listener

BIN = Path(sys.executable).parent


def _run(exe: str, *args: str, timeout_s: str = "1.5") -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env["ROTA_CONNECT_TIMEOUT_S"] = timeout_s
    t0 = time.monotonic()
    out = subprocess.run([str(BIN / exe), *args], capture_output=True, text=True, timeout=120, env=env)
    return out, time.monotonic() - t0


def _one_line(out: subprocess.CompletedProcess) -> str:
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    return lines[0]


@pytest.mark.parametrize("exe,prefix", [("kubectl-rota", []), ("rota", ["k8s"])])
def test_status_with_a_silent_api_server(tmp_path, exe, prefix):
    with silent_listener() as address:
        kc = kubeconfig(tmp_path / "kubeconfig", f"http://{address}")
        out, took = _run(exe, *prefix, "status", "--kubeconfig", kc)
    line = _one_line(out)
    assert f"Kubernetes API server at http://{address}" in line and "no answer within 1.5 s" in line
    assert "--timeout" in line and "ROTA_CONNECT_TIMEOUT_S" in line
    assert 1.4 < took < 30  # one request timeout: urllib3's 3 retries (4 timeouts) are off


def test_status_with_a_refused_api_server(tmp_path):
    address = f"127.0.0.1:{free_port()}"
    out, _ = _run("kubectl-rota", "status", "--kubeconfig", kubeconfig(tmp_path / "kubeconfig", f"http://{address}"))
    line = _one_line(out)
    assert f"Kubernetes API server at http://{address} (" in line and "refused" in line.lower()


def test_status_with_a_silent_orchestrator_and_the_timeout_flag():
    with silent_listener() as address:
        out, took = _run("kubectl-rota", "status", "--orchestrator", address, "--timeout", "1", timeout_s="60")
    line = _one_line(out)
    assert f"the orchestrator at {address} did not answer within 1 s" in line and "--timeout" in line
    assert took < 30


def test_tenant_check_claim_with_a_silent_api_server(tmp_path):
    with silent_listener() as address:
        kc = kubeconfig(tmp_path / "kubeconfig", f"http://{address}")
        out, took = _run("rota", "k8s", "tenant", "--group", "grp0", "--image", "img:1", "--check-claim",
                         "--kubeconfig", kc, "--", "python", "train.py")
    line = _one_line(out)
    assert "cannot read ResourceClaim" in line and f"API server at http://{address}" in line
    assert "ROTA_CONNECT_TIMEOUT_S" in line and took < 30


def test_status_through_the_api_server_to_a_silent_orchestrator_names_the_pod(tmp_path):
    """The API server answers (FakePortForwardApi, a fake: the pod list and a port-forward relaying to a real
    socket), the orchestrator behind the port-forward never does: the line names the pod, not 127.0.0.1."""
    labels = {"app.kubernetes.io/name": "rota-orchestrator", "app.kubernetes.io/part-of": "rota"}
    with silent_listener() as address:
        with FakePortForwardApi("rota-system", {"rota-orchestrator-a": (True, {50051: address})}, labels) as api:
            kc = kubeconfig(tmp_path / "kubeconfig", api.url)
            out, took = _run("kubectl-rota", "status", "--kubeconfig", kc, "--timeout", "1.5", timeout_s="60")
    line = _one_line(out)
    assert "did not answer within 1.5 s" in line and took < 30
    assert "in pod rota-system/rota-orchestrator-a (through the API server's port-forward)" in line, line
