"""Service names come from the generated descriptors and match the v1alpha1 protos; the
committed stubs equal a fresh generation with the pinned grpcio-tools."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from rota.wire import rota_v1_pb2, snapshot_agent_pb2, timeslice_orchestrator_pb2

ROOT = pathlib.Path(__file__).resolve().parents[3]  # the repository (this file is in packages/core/tests)


def test_full_service_names():
    assert (timeslice_orchestrator_pb2.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"].full_name
            == "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService")
    assert (snapshot_agent_pb2.DESCRIPTOR.services_by_name["SnapshotAgentService"].full_name
            == "snapshot_agent.v1alpha1.SnapshotAgentService")
    assert rota_v1_pb2.DESCRIPTOR.services_by_name["RotaService"].full_name == "rota.v1.RotaService"


def test_wire_field_numbers():
    fields = {f.name: f.number for f in snapshot_agent_pb2.GetOperationResponse.DESCRIPTOR.fields}
    assert fields == {"status": 1, "storage_bytes": 2, "snapshot_device_bytes": 3, "elapsed_ms": 4, "error": 5}
    group = {f.name: f.number for f in timeslice_orchestrator_pb2.GroupStatus.DESCRIPTOR.fields}
    assert group["loaded_job"] == 7 and group["waiter_queue_depth"] == 6
    backend = {f.name: f.number for f in snapshot_agent_pb2.BackendConfig.DESCRIPTOR.fields}
    assert backend == {"cuda": 1, "app_endpoint": 2, "app_channel": 3, "direct_memory": 4, "memory_regions": 5}


def test_committed_stubs_are_reproducible():
    r = subprocess.run([sys.executable, f"{ROOT}/scripts/gen_protos.py", "--check"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_orchestrator_serves_grpc_health(orchestrator):
    """Kubernetes probes (rota k8s render) ask grpc.health.v1 on the orchestrator port."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    endpoint, _ = orchestrator
    with grpc.insecure_channel(endpoint) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService", "rota.v1.RotaService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
