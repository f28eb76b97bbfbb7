"""`kubectl-rota`: an executable on PATH, so `kubectl rota status|render|tenant` work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import yaml
from click.testing import CliRunner

from rota._generated import rota_v1_pb2 as pb
from rota._generated import rota_v1_pb2_grpc as pb_grpc
from rota_k8s import load_values, render
from rota_k8s.cli import k8s

EXE = Path(sys.executable).with_name("kubectl-rota")


def test_kubectl_rota_executable_renders() -> None:
    assert EXE.exists(), f"{EXE} missing: [project.scripts] kubectl-rota is not installed"
    out = subprocess.run([str(EXE), "render", "--namespace", "gpu-share", "--kube-version", "1.34"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    assert list(yaml.safe_load_all(out.stdout)) == render(load_values(overrides={"namespace": "gpu-share"}))
    helped = subprocess.run([str(EXE), "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert helped.stdout.startswith("Usage: kubectl rota ")


def test_kubectl_rota_status_shows_holder_and_queue(orchestrator: tuple[str, Any]) -> None:
    endpoint, _engine = orchestrator
    with grpc.insecure_channel(endpoint) as ch:
        pb_grpc.RotaServiceStub(ch).Acquire(pb.TurnRequest(job_id="ppo-1", group_id="grp0"), timeout=30)
    result = CliRunner().invoke(k8s, ["status", "--orchestrator", endpoint])
    assert result.exit_code == 0, result.output
    assert "group grp0" in result.stdout and "holder=ppo-1" in result.stdout
    as_json = CliRunner().invoke(k8s, ["status", "grp0", "--json"], env={"ROTA_ORCHESTRATOR": endpoint})
    assert as_json.exit_code == 0 and '"holder": "ppo-1"' in as_json.stdout


def test_kubectl_rota_status_says_how_to_reach_the_orchestrator() -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROTA_ORCHESTRATOR"}
    result = CliRunner().invoke(k8s, ["status"], env={**env, "ROTA_ORCHESTRATOR": ""})
    assert result.exit_code == 2 and "port-forward svc/rota-orchestrator" in result.stderr


def test_kubectl_rota_status_unreachable_orchestrator_is_one_line() -> None:
    from rota.testing import free_port

    result = CliRunner().invoke(k8s, ["status", "--orchestrator", f"127.0.0.1:{free_port()}"])
    assert result.exit_code == 1 and result.stderr.startswith("Error: 127.0.0.1:")
    assert "Traceback" not in result.output
