"""Who may do what on the agent: owners of registrations, the pid door, tenant tokens, and the bounds.

A real agent (in this process, real gRPC, real pid door on a Unix socket) and real clients;
the cuda backend's driver is the FakeCudaDriver of test_cuda_backend (no GPU here).
"""

from __future__ import annotations

import os
import threading

import grpc
import pytest
from agentlib import jobs, run_op
from test_cuda_backend import FakeCudaDriver

from rota import auth
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import Agent, WorkloadClient, _agent, running_agent
from rota_agent.backends import AppChannelBackend, CudaBackend
from rota_agent.backends.cuda import CHECKPOINTED
from rota_agent_client import door

KEY = b"k" * 32


def _client(endpoint: str, job: str, group: str = "g", **kw) -> WorkloadClient:
    return WorkloadClient(endpoint, job, group, on_snapshot=lambda *_: None, on_restore=lambda *_: None, **kw)


def _refusal(client: WorkloadClient, timeout: float = 10) -> grpc.StatusCode:
    try:
        with pytest.raises(Exception) as info:
            client.wait_registered(timeout)
    finally:
        client.close()
    return info.value.code


def _raw_refusal(stub: sa_grpc.SnapshotAgentServiceStub, job: str) -> tuple[grpc.StatusCode, str]:
    """Register ``job`` with a bare v1alpha1 stream (no metadata) and return the agent's refusal."""
    call = stub.WorkloadChannel(iter([sa.WorkloadMessage(register=sa.RegisterWorkload(job_id=job, group="g"))]),
                                timeout=5)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    return info.value.code(), info.value.details()


def test_anonymous_job_takes_a_second_channel_only_once_the_first_closed(agent, agent_stub):
    first = _client(agent[0], "anon").wait_registered()
    code, details = _raw_refusal(agent_stub, "anon")
    assert code == grpc.StatusCode.ALREADY_EXISTS and "anon" in details
    first.close()
    again = _client(agent[0], "anon").wait_registered()  # a reconnect after the old channel closed
    again.close()


def test_ranks_of_one_uid_share_a_job_through_the_door(agent, socket_dir):
    unix = f"unix:{socket_dir}/agent.sock"
    ranks = [_client(unix, "multi").wait_registered() for _ in range(2)]
    try:
        with grpc.insecure_channel(agent[0]) as ch:
            stub = sa_grpc.SnapshotAgentServiceStub(ch)
            assert run_op(stub, "snapshot", "multi").status == sa.OPERATION_STATUS_COMPLETE
        assert [c.commands[0][:2] for c in ranks] == [("snapshot", True)] * 2  # both ranks were parked
        assert _refusal(_client(agent[0], "multi", backend="noop")) == grpc.StatusCode.PERMISSION_DENIED
    finally:
        for c in ranks:
            c.close()


def test_door_tickets_are_one_time_and_name_the_caller(socket_dir, agent):
    ticket = door.fetch(os.path.join(socket_dir, "pid.sock"))
    issued = agent[1].door
    got = []
    done = threading.Event()

    def redeem() -> None:  # tickets live on the agent's loop
        got.extend([issued.redeem(ticket), issued.redeem(ticket), issued.redeem("forged")])
        done.set()

    agent[1]._loop.call_soon_threadsafe(redeem)
    assert done.wait(5)
    assert got[0] is not None and got[0].pid == os.getpid() and got[0].uid == os.getuid()
    assert got[1:] == [None, None]


def test_a_claimed_child_pid_is_taken_and_parked(target, socket_dir):
    drv = FakeCudaDriver()
    a = Agent({"cuda": CudaBackend(lambda: drv), "app_channel": AppChannelBackend()})
    with running_agent(a, socket_dir=socket_dir) as (ep, _), grpc.insecure_channel(ep) as ch:
        client = _client(f"unix:{socket_dir}/agent.sock", "child", backend="cuda", pid=target).wait_registered()
        try:
            stub = sa_grpc.SnapshotAgentServiceStub(ch)
            assert run_op(stub, "snapshot", "child").status == sa.OPERATION_STATUS_COMPLETE
            assert drv.states == {target: CHECKPOINTED} and drv.calls[0] == ("lock", target)
        finally:
            client.close()
        assert _refusal(_client(ep, "tcp-cuda", backend="cuda", pid=target, proof="")) == \
            grpc.StatusCode.INVALID_ARGUMENT  # no door, no proof: the claim alone is worth nothing


def test_tenant_tokens_see_and_act_for_their_own_job_only(socket_dir):
    with running_agent(auth=auth.ServerAuth(key=KEY), socket_dir=socket_dir) as (ep, _):
        mine = _client(ep, "mine", token=auth.issue(KEY, group="g", job="mine")).wait_registered()
        other = _client(ep, "other", token=auth.issue(KEY, group="g", job="other")).wait_registered()
        try:
            tenant = sa_grpc.SnapshotAgentServiceStub(auth.channel(ep, token=auth.issue(KEY, group="g", job="mine")))
            admin = sa_grpc.SnapshotAgentServiceStub(auth.channel(ep, token=auth.issue(KEY, admin=True)))
            assert set(jobs(tenant)) == {"mine"} and set(jobs(admin)) == {"mine", "other"}
            assert run_op(tenant, "snapshot", "mine").status == sa.OPERATION_STATUS_COMPLETE
            op = admin.Snapshot(sa.SnapshotRequest(job_id="other", group="g"), timeout=5).operation_id
            with pytest.raises(grpc.RpcError) as info:
                tenant.GetOperation(sa.GetOperationRequest(operation_id=op), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.RpcError) as info:
                sa_grpc.SnapshotAgentServiceStub(grpc.insecure_channel(f"unix:{socket_dir}/agent.sock")).Status(
                    sa.StatusRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the Unix socket checks tokens too
        finally:
            mine.close()
            other.close()


def test_jobs_per_owner_are_bounded_and_closed_jobs_forgotten(monkeypatch, agent, agent_stub):
    monkeypatch.setattr(_agent, "MAX_JOBS_PER_OWNER", 2)
    agent[1].keep_closed_s = 0.5

    def fail(*_: object) -> None:
        raise RuntimeError("no room on the device")

    held = [WorkloadClient(agent[0], f"j{i}", "g", on_snapshot=fail, on_restore=lambda *_: None).wait_registered()
            for i in range(2)]
    try:
        code, details = _raw_refusal(agent_stub, "j2")
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "2 jobs" in details
        for i in range(2):
            assert run_op(agent_stub, "snapshot", f"j{i}").status == sa.OPERATION_STATUS_FAILED
    finally:
        for c in held:
            c.close()
    assert {j: st for j, (st, _) in jobs(agent_stub).items()} == {"j0": sa.JOB_STATE_FAULTED,
                                                                  "j1": sa.JOB_STATE_FAULTED}  # kept a while
    for _ in range(200):
        if not jobs(agent_stub):
            break
        threading.Event().wait(0.02)
    assert jobs(agent_stub) == {}  # then forgotten
    _client(agent[0], "j2").wait_registered().close()  # room again
