"""Bad requests get clear errors with the right gRPC codes; one operation per job at a time."""

from __future__ import annotations

import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from rota.wire import snapshot_agent_pb2 as sa
from rota_agent import WorkloadClient


def _code(call, *args) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, timeout=5)
    return info.value.code(), info.value.details()


def test_snapshot_of_unknown_job_is_not_found(agent_stub):
    code, msg = _code(agent_stub.Snapshot, sa.SnapshotRequest(job_id="ghost", group="g"))
    assert code == grpc.StatusCode.NOT_FOUND and "ghost" in msg and "WorkloadChannel" in msg
    code, _ = _code(agent_stub.GetOperation, sa.GetOperationRequest(operation_id="nope"))
    assert code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize(("config", "code", "words"), [
    (sa.BackendConfig(app_endpoint=sa.AppEndpointConfig(app=sa.APP_VLLM, endpoints=["http://h:1"])), "NOT_FOUND",
     "endpoints a registered job declared"),
    (sa.BackendConfig(cuda=sa.CudaBackendConfig(explicit_target=sa.ProcessTarget(pids=[-5]))), "INVALID_ARGUMENT",
     "pid -5"),
    (sa.BackendConfig(memory_regions=sa.MemoryRegionsBackendConfig()), "UNIMPLEMENTED", "memory_regions"),
    (sa.BackendConfig(direct_memory=sa.DirectMemoryBackendConfig()), "UNIMPLEMENTED", "direct_memory"),
])
def test_bad_backend_config(agent_stub, config, code, words):
    got, msg = _code(agent_stub.Snapshot, sa.SnapshotRequest(job_id="j1", group="g", backend_config=config))
    assert got == getattr(grpc.StatusCode, code) and words in msg and "j1" in msg


@pytest.mark.parametrize(("app", "endpoints", "words"), [
    (sa.APP_VLLM, ["ftp://x"], "ftp://x"),
    (sa.APP_VLLM, ["http://user@h:1"], "no user"),
    (sa.APP_VLLM, ["http://h:1/" + "p" * 600], "at most 512"),
    (sa.APP_VLLM, [f"http://h:{i}" for i in range(17)], "1 to 16 endpoints"),
    (3, ["http://h:1"], "APP_VLLM"),
])
def test_bad_endpoint_registration(agent, agent_stub, app, endpoints, words):
    client = WorkloadClient(agent[0], "j1", "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None,
                            app=app, endpoints=endpoints)
    try:
        with pytest.raises(Exception) as info:
            client.wait_registered(10)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in str(info.value)
        assert "p" * 100 not in str(info.value)  # a long URL is not echoed whole
        assert agent_stub.Status(sa.StatusRequest(), timeout=5).job_statuses == []
    finally:
        client.close()


def test_malformed_ids(agent_stub):
    assert _code(agent_stub.Snapshot, sa.SnapshotRequest(job_id="", group="g"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(agent_stub.Restore, sa.RestoreRequest(job_id="a b"))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(agent_stub.GetOperation, sa.GetOperationRequest())[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_second_operation_on_same_job_is_aborted(agent, agent_stub):
    gate = threading.Event()
    client = WorkloadClient(agent[0], "busy", "g", on_snapshot=lambda *_: gate.wait(30),
                            on_restore=lambda *_: None).wait_registered()
    try:
        bad = sa.BackendConfig(app_channel=sa.AppChannelConfig(mode=7))
        code, msg = _code(agent_stub.Snapshot, sa.SnapshotRequest(job_id="busy", group="g", backend_config=bad))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "mode 7" in msg
        op = agent_stub.Snapshot(sa.SnapshotRequest(job_id="busy", group="g"), timeout=5).operation_id
        assert agent_stub.GetOperation(sa.GetOperationRequest(operation_id=op), timeout=5).status == \
            sa.OPERATION_STATUS_PENDING
        code, msg = _code(agent_stub.Snapshot, sa.SnapshotRequest(job_id="busy", group="g"))
        assert code == grpc.StatusCode.ABORTED and op in msg
        assert _code(agent_stub.Restore, sa.RestoreRequest(job_id="busy", group="g"))[0] == grpc.StatusCode.ABORTED
        code, msg = _code(agent_stub.Snapshot, sa.SnapshotRequest(job_id="busy", group="other"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "other" in msg
        gate.set()
        for _ in range(500):
            got = agent_stub.GetOperation(sa.GetOperationRequest(operation_id=op), timeout=5)
            if got.status != sa.OPERATION_STATUS_PENDING:
                break
            threading.Event().wait(0.02)
        assert got.status == sa.OPERATION_STATUS_COMPLETE and not got.HasField("error")
        jobs = {j.job_id: j.state for j in agent_stub.Status(sa.StatusRequest(), timeout=5).job_statuses}
        assert jobs["busy"] == sa.JOB_STATE_SAVED
    finally:
        gate.set()
        client.close()


def test_restore_of_faulted_job_is_failed_precondition(agent, agent_stub):
    def boom(*_: object) -> None:
        raise RuntimeError("adapter exploded")

    client = WorkloadClient(agent[0], "bad", "g", on_snapshot=boom, on_restore=lambda *_: None).wait_registered()
    try:
        op = agent_stub.Snapshot(sa.SnapshotRequest(job_id="bad", group="g"), timeout=5).operation_id
        for _ in range(500):
            got = agent_stub.GetOperation(sa.GetOperationRequest(operation_id=op), timeout=5)
            if got.status != sa.OPERATION_STATUS_PENDING:
                break
            threading.Event().wait(0.02)
        assert got.status == sa.OPERATION_STATUS_FAILED and "adapter exploded" in got.error
        code, msg = _code(agent_stub.Restore, sa.RestoreRequest(job_id="bad", group="g"))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "FAULTED" in msg
    finally:
        client.close()


def test_channel_must_start_with_register(agent, agent_stub):
    call = agent_stub.WorkloadChannel(iter([sa.WorkloadMessage(result=sa.CommandResult(command_id="x"))]), timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "register" in info.value.details()
    call = agent_stub.WorkloadChannel(iter([sa.WorkloadMessage(register=sa.RegisterWorkload(job_id="j", group=""))]),
                                      timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "group" in info.value.details()


def test_health_and_service_name(agent):
    from rota_agent._server import SERVICE_NAME

    assert SERVICE_NAME == "snapshot_agent.v1alpha1.SnapshotAgentService"
    with grpc.insecure_channel(agent[0]) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE_NAME):
            assert h.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING
