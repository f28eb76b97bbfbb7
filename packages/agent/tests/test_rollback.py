"""An app_channel park or restore that fails or misses its deadline is rolled back, FAULTs the
job with the cause, and FAULTED is retried on the same agent. Real tenant subprocesses,
real gRPC; the hooks that hang wait for a file the test creates."""

from __future__ import annotations

import time

import grpc
import pytest
from agentlib import jobs, run_op

from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import Agent, running_agent


@pytest.fixture
def stub():
    with running_agent(Agent(op_timeout_s=1.0)) as (ep, _), grpc.insecure_channel(ep) as ch:
        yield ep, sa_grpc.SnapshotAgentServiceStub(ch)


def _until(tenant, want: dict) -> dict:
    """Ask the tenant for its state until it matches ``want`` (bounded by count, not time)."""
    for _ in range(1000):
        check = tenant.ask("check")
        if all(check[k] == v for k, v in want.items()):
            return check
        time.sleep(0.02)
    raise AssertionError(f"tenant never reached {want}: {check}")


def _tenant(tenants, ep: str, job: str, *flags: str):
    return tenants("--mode", "v1", "--orch", "127.0.0.1:1", "--agent", ep, "--job", job, "--group", "g", *flags)


def test_park_past_deadline_rolls_back_to_resident_and_retries(stub, tenants, tmp_path):
    ep, s = stub
    gate = tmp_path / "park-may-finish"
    t = _tenant(tenants, ep, "slow-park", "--block-on-park", str(gate))
    got = run_op(s, "snapshot", "slow-park")
    assert got.status == sa.OPERATION_STATUS_FAILED
    assert "missed its 1 s deadline" in got.error and "rolled back" in got.error and "resident" in got.error
    state, more = jobs(s)["slow-park"]
    assert state == sa.JOB_STATE_FAULTED and "deadline" in more.fault
    gate.touch()  # the park finishes late; the queued rollback brings the state back
    _until(t, {"parks": 1, "restores": 1, "on_device": True, "identical": True})
    assert run_op(s, "snapshot", "slow-park").status == sa.OPERATION_STATUS_COMPLETE  # FAULTED is retryable
    assert jobs(s)["slow-park"][0] == sa.JOB_STATE_SAVED
    assert run_op(s, "restore", "slow-park").status == sa.OPERATION_STATUS_COMPLETE
    _until(t, {"parks": 2, "restores": 2, "on_device": True, "identical": True})


def test_restore_past_deadline_rolls_back_to_parked_and_retries(stub, tenants, tmp_path):
    ep, s = stub
    gate = tmp_path / "restore-may-finish"
    t = _tenant(tenants, ep, "slow-restore", "--block-on-restore", str(gate))
    assert run_op(s, "snapshot", "slow-restore").status == sa.OPERATION_STATUS_COMPLETE
    got = run_op(s, "restore", "slow-restore")
    assert got.status == sa.OPERATION_STATUS_FAILED and "deadline" in got.error and "parked" in got.error
    assert jobs(s)["slow-restore"][0] == sa.JOB_STATE_FAULTED
    with pytest.raises(grpc.RpcError) as info:  # its state cannot be trusted until a snapshot succeeds
        s.Restore(sa.RestoreRequest(job_id="slow-restore"), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "deadline" in info.value.details()
    gate.touch()  # the restore finishes late; the queued rollback parks it again
    _until(t, {"parks": 2, "restores": 1, "on_device": False})
    assert run_op(s, "snapshot", "slow-restore").status == sa.OPERATION_STATUS_COMPLETE
    assert run_op(s, "restore", "slow-restore").status == sa.OPERATION_STATUS_COMPLETE
    _until(t, {"restores": 2, "on_device": True, "identical": True})
    assert jobs(s)["slow-restore"][0] == sa.JOB_STATE_RUNNING


def test_failed_park_leaves_the_job_resident_and_faulted(stub, tenants):
    ep, s = stub
    t = _tenant(tenants, ep, "says-no", "--fail-on-park")
    got = run_op(s, "snapshot", "says-no")
    assert got.status == sa.OPERATION_STATUS_FAILED and "the device said no" in got.error
    state, more = jobs(s)["says-no"]
    assert state == sa.JOB_STATE_FAULTED and "the device said no" in more.fault
    assert t.ask("check")["on_device"] is True  # outgoing stays resident
