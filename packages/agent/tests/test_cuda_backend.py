"""The cuda backend's logic (lock → checkpoint → restore → unlock, limits, deadlines) on CPU.

FakeCudaDriver stands in for libcuda only; the agent, its RPCs, its pid door and the
target process (a real sleeping subprocess, a child of this registered test process)
are real.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import grpc
import pytest
from agentlib import registered_here

from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import Agent, running_agent
from rota_agent.backends import AppChannelBackend, CudaBackend
from rota_agent.backends.cuda import CHECKPOINTED, CUDA_ERROR_NOT_SUPPORTED, LOCKED, RUNNING, CudaError


class FakeCudaDriver:
    """The checkpoint API's per-pid state machine, with injectable hangs and errors."""

    def __init__(self, version: int = 12080) -> None:
        self.version, self.states, self.calls = version, {}, []
        self.hang = threading.Event()  # checkpoint blocks while this is clear... if hang_checkpoint
        self.hang_checkpoint = False
        self.fail_checkpoint = 0

    def driver_version(self) -> int:
        return self.version

    def get_state(self, pid: int) -> int:
        return self.states.get(pid, RUNNING)

    def _move(self, call: str, pid: int, want: int, to: int) -> None:
        self.calls.append((call, pid))
        if self.get_state(pid) != want:
            raise CudaError(call, 401, "CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = to

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._move("lock", pid, RUNNING, LOCKED)

    def checkpoint(self, pid: int) -> None:
        if self.hang_checkpoint:
            self.hang.wait(30)
        if self.fail_checkpoint:
            self.calls.append(("checkpoint", pid))
            raise CudaError("cuCheckpointProcessCheckpoint", self.fail_checkpoint, "CUDA_ERROR_NOT_SUPPORTED")
        self._move("checkpoint", pid, LOCKED, CHECKPOINTED)

    def restore(self, pid: int) -> None:
        self._move("restore", pid, CHECKPOINTED, LOCKED)

    def unlock(self, pid: int) -> None:
        self._move("unlock", pid, LOCKED, RUNNING)


@contextlib.contextmanager
def _agent(drv: FakeCudaDriver, socket_dir: str, **kw):
    """An agent with the fake driver; job "whole" is this process, registered through the pid door."""
    agent = Agent({"cuda": CudaBackend(lambda: drv, **kw), "app_channel": AppChannelBackend()})
    with running_agent(agent, socket_dir=socket_dir) as served, registered_here(socket_dir):
        yield served


def _wait(stub, op: str) -> sa.GetOperationResponse:
    for _ in range(1000):
        got = stub.GetOperation(sa.GetOperationRequest(operation_id=op), timeout=5)
        if got.status != sa.OPERATION_STATUS_PENDING:
            return got
        time.sleep(0.01)
    raise AssertionError("operation never finished")


def _req(pid: int, cls=sa.SnapshotRequest):
    return cls(job_id="whole", group="g", backend_config=sa.BackendConfig(
        cuda=sa.CudaBackendConfig(explicit_target=sa.ProcessTarget(pids=[pid]))))


def test_park_and_restore_drive_the_driver_in_order(target, socket_dir):
    drv = FakeCudaDriver()
    with _agent(drv, socket_dir) as (ep, _), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        assert _wait(stub, stub.Snapshot(_req(target), timeout=5).operation_id).status == sa.OPERATION_STATUS_COMPLETE
        assert drv.states[target] == CHECKPOINTED
        restore = sa.RestoreRequest(job_id="whole", group="g")  # no config: restored the way it was parked
        assert _wait(stub, stub.Restore(restore, timeout=5).operation_id).status == sa.OPERATION_STATUS_COMPLETE
        assert drv.calls == [("lock", target), ("checkpoint", target), ("restore", target), ("unlock", target)]
        assert drv.states[target] == RUNNING


def test_deprecated_backend_enum_uses_registered_pids_or_says_which_are_missing(socket_dir):
    drv = FakeCudaDriver()
    with _agent(drv, socket_dir) as (ep, _), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            stub.Snapshot(sa.SnapshotRequest(job_id="nobody", backend=sa.BACKEND_CUDA), timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "registered job" in info.value.details()
        op = stub.Snapshot(sa.SnapshotRequest(job_id="whole", backend=sa.BACKEND_CUDA), timeout=5).operation_id
        assert _wait(stub, op).status == sa.OPERATION_STATUS_COMPLETE
        assert drv.calls == [("lock", os.getpid()), ("checkpoint", os.getpid())]  # its proven pid: this process


@pytest.mark.parametrize(("kw", "version", "words"), [
    ({"machine": "aarch64"}, 12080, "x86-64"),
    ({}, 12040, "570"),
])
def test_platform_limits_are_refused_up_front(target, socket_dir, kw, version, words):
    with _agent(FakeCudaDriver(version), socket_dir, **kw) as (ep, _), grpc.insecure_channel(ep) as ch:
        with pytest.raises(grpc.RpcError) as info:
            sa_grpc.SnapshotAgentServiceStub(ch).Snapshot(_req(target), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and words in info.value.details()


def test_nccl_process_is_refused(tmp_path, socket_dir):
    """A fake /proc: this process (as registered, same start time) and its "child" 4242 mapping NCCL's memory."""
    me = tmp_path / str(os.getpid())
    me.mkdir()
    with open(f"/proc/{os.getpid()}/stat", encoding="ascii") as f:
        (me / "stat").write_text(f.read())
    (tmp_path / "4242").mkdir()
    (tmp_path / "4242" / "stat").write_text(f"4242 (python) S {os.getpid()} " + "0 " * 30 + "\n")
    (tmp_path / "4242" / "maps").write_text("7f00-7f01 r-xp 0 00:00 1 /usr/lib/libnccl.so.2\n"
                                            "7f02-7f03 rw-s 0 00:05 9 /dev/shm/nccl-Ab12Cd\n")
    drv = FakeCudaDriver()
    with _agent(drv, socket_dir, proc_root=str(tmp_path)) as (ep, _), grpc.insecure_channel(ep) as ch:
        with pytest.raises(grpc.RpcError) as info:
            sa_grpc.SnapshotAgentServiceStub(ch).Snapshot(_req(4242), timeout=5)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED and "NCCL" in info.value.details()
    assert drv.calls == []


def test_hung_checkpoint_misses_deadline_faults_job_and_rolls_back(target, socket_dir):
    drv = FakeCudaDriver()
    drv.hang_checkpoint = True
    with _agent(drv, socket_dir, step_timeout_s=0.3) as (ep, _), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        got = _wait(stub, stub.Snapshot(_req(target), timeout=5).operation_id)
        assert got.status == sa.OPERATION_STATUS_FAILED and "UVM" in got.error and str(target) in got.error
        jobs = {j.job_id: j.state for j in stub.Status(sa.StatusRequest(), timeout=5).job_statuses}
        assert jobs["whole"] == sa.JOB_STATE_FAULTED
        drv.hang.set()
        assert ("unlock", target) in drv.calls  # rollback unlocked the process


def test_not_supported_error_names_the_likely_cause(target, socket_dir):
    drv = FakeCudaDriver()
    drv.fail_checkpoint = CUDA_ERROR_NOT_SUPPORTED
    with _agent(drv, socket_dir) as (ep, _), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        got = _wait(stub, stub.Snapshot(_req(target), timeout=5).operation_id)
    assert got.status == sa.OPERATION_STATUS_FAILED and "IPC" in got.error and "NOT_SUPPORTED" in got.error
    assert drv.states[target] == RUNNING
