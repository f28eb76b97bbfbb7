"""`kubectl-rota`: an executable on PATH, so `kubectl rota status|render|tenant` work."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc
import yaml
from click.testing import CliRunner
from k8s_fake_portforward import FakePortForwardApi, kubeconfig
from prometheus_client.parser import text_string_to_metric_families

from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
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


LABELS = {"app.kubernetes.io/name": "rota-orchestrator", "app.kubernetes.io/part-of": "rota"}


def test_kubectl_rota_status_finds_the_orchestrator_through_the_kubeconfig(orchestrator: tuple[str, Any],
                                                                           tmp_path: Path) -> None:
    """No --orchestrator: a ready orchestrator pod of the kubeconfig's cluster, reached by a port-forward through
    the API server (FakePortForwardApi, a fake: no API server or kubelet runs here) to the real orchestrator."""
    endpoint, _engine = orchestrator
    with grpc.insecure_channel(endpoint) as ch:
        pb_grpc.RotaServiceStub(ch).Acquire(pb.TurnRequest(job_id="ppo-1", group_id="grp0"), timeout=30)
    pods = {"rota-orchestrator-a": (False, {}), "rota-orchestrator-b": (True, {50051: endpoint})}
    with FakePortForwardApi("rota-system", pods, LABELS) as api:
        kc = kubeconfig(tmp_path / "kubeconfig", api.url)
        env = {"ROTA_ORCHESTRATOR": ""}
        table = CliRunner().invoke(k8s, ["status", "--kubeconfig", kc], env=env)
        assert table.exit_code == 0, table.output
        assert "group grp0" in table.stdout and "holder=ppo-1" in table.stdout
        prom = CliRunner().invoke(k8s, ["status", "--kubeconfig", kc, "--prometheus"], env=env)
        assert prom.exit_code == 0, prom.output
        samples = {s.name: s for f in text_string_to_metric_families(prom.stdout) for s in f.samples}
        assert samples, prom.stdout
        as_json = CliRunner().invoke(k8s, ["status", "grp0", "--kubeconfig", kc, "--json"], env=env)
        assert json.loads(as_json.stdout)["groups"][0]["holder"] == "ppo-1"
        assert api.forwards == [("rota-orchestrator-b", 50051)] * 3  # only the ready pod, its gRPC port

        none_ready = CliRunner().invoke(k8s, ["status", "--kubeconfig", kc, "--namespace", "elsewhere"], env=env)
        assert none_ready.exit_code == 1
        assert none_ready.stderr.strip().splitlines() == [
            "Error: the orchestrator: no rota orchestrator pod in namespace 'elsewhere' (app.kubernetes.io/name="
            "rota-orchestrator,app.kubernetes.io/part-of=rota); give --namespace, or --orchestrator HOST:PORT"]


def test_kubectl_rota_status_without_kubeconfig_says_how_to_reach_the_orchestrator(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "ROTA_ORCHESTRATOR"}
    result = CliRunner().invoke(k8s, ["status", "--kubeconfig", str(tmp_path / "missing")],
                                env={**env, "ROTA_ORCHESTRATOR": ""})
    assert result.exit_code == 1 and "no Kubernetes configuration" in result.stderr
    assert "--orchestrator HOST:PORT" in result.stderr and "Traceback" not in result.output


def test_kubectl_rota_status_unreachable_orchestrator_is_one_line() -> None:
    from rota.testing import free_port

    address = f"127.0.0.1:{free_port()}"
    result = CliRunner().invoke(k8s, ["status", "--orchestrator", address])
    assert result.exit_code == 1 and result.stderr.startswith(f"Error: cannot reach the orchestrator at {address} (")
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.output
