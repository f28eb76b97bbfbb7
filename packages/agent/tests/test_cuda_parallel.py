"""The cuda backend with several pids: each step runs for up to ``parallel`` pids at once, every pid is locked
before any is checkpointed (and restored before any is unlocked), a failure of one pid is undone for the
others, and driver calls never run on the agent's event loop.

FakeCudaDriver stands in for libcuda only (each call here takes a while, as a real one does); the agent,
its RPCs, its pid door and the target processes (sleeping children of this registered test process) are
real.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time

import grpc
import pytest
from agentlib import jobs, registered_here, run_op, wait_op
from test_cuda_backend import FakeCudaDriver

from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import Agent, running_agent
from rota_agent.backends import AppChannelBackend, CudaBackend
from rota_agent.backends.cuda import CHECKPOINTED, RUNNING, CudaError
from rota_agent.errors import BadBackendConfig

STEP_S = 0.15  # how long each fake lock/checkpoint/restore/unlock takes


class TimedDriver(FakeCudaDriver):
    """FakeCudaDriver whose moving calls take ``STEP_S`` and are timed; ``fail``: (call, pid) that fails."""

    def __init__(self) -> None:
        super().__init__()
        self.timed: list[tuple[str, int, float, float]] = []
        self.fail: tuple[str, int] | None = None
        self.guard = threading.Lock()

    def _move(self, call: str, pid: int, want: int, to: int) -> None:
        t0 = time.monotonic()
        time.sleep(STEP_S)
        try:
            if self.fail == (call, pid):
                self.calls.append((call, pid))
                raise CudaError(f"cuCheckpointProcess{call.title()}", 2, "CUDA_ERROR_OUT_OF_MEMORY")
            super()._move(call, pid, want, to)
        finally:
            with self.guard:
                self.timed.append((call, pid, t0, time.monotonic()))

    def at_once(self, call: str) -> int:
        """The most ``call`` calls that were in flight together."""
        edges = sorted([(t0, 1) for c, _, t0, _ in self.timed if c == call]
                       + [(t1, -1) for c, _, _, t1 in self.timed if c == call])
        now = most = 0
        for _, step in edges:
            now += step
            most = max(most, now)
        return most

    def span(self, call: str) -> tuple[float, float]:
        mine = [(t0, t1) for c, _, t0, t1 in self.timed if c == call]
        return min(t0 for t0, _ in mine), max(t1 for _, t1 in mine)


@pytest.fixture
def targets():
    """Three live children of this process (sleeping; killed afterwards)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(3)]
    yield sorted(p.pid for p in procs)
    for p in procs:
        p.kill()
        p.wait(5)


@contextlib.contextmanager
def _stub(drv: FakeCudaDriver, socket_dir: str, **kw):
    agent = Agent({"cuda": CudaBackend(lambda: drv, **kw), "app_channel": AppChannelBackend()})
    with running_agent(agent, socket_dir=socket_dir) as (ep, _), registered_here(socket_dir), \
            grpc.insecure_channel(ep) as ch:
        yield sa_grpc.SnapshotAgentServiceStub(ch)


def _cfg(pids: list[int]) -> dict:
    return {"backend_config": sa.BackendConfig(cuda=sa.CudaBackendConfig(
        explicit_target=sa.ProcessTarget(pids=pids)))}


@pytest.mark.parametrize("parallel", [1, 8])
def test_steps_run_for_parallel_pids_at_once_and_each_step_ends_before_the_next(targets, socket_dir, parallel):
    drv = TimedDriver()
    with _stub(drv, socket_dir, parallel=parallel) as stub:
        got = run_op(stub, "snapshot", "whole", "g", **_cfg(targets))
        assert got.status == sa.OPERATION_STATUS_COMPLETE, got.error
        assert all(drv.states[p] == CHECKPOINTED for p in targets)
        assert run_op(stub, "restore", "whole", "g").status == sa.OPERATION_STATUS_COMPLETE
    assert all(drv.states[p] == RUNNING for p in targets)
    for call in ("lock", "checkpoint", "restore", "unlock"):
        assert sorted(p for c, p in drv.calls if c == call) == targets
        assert drv.at_once(call) == min(parallel, len(targets)), call
    # every pid locked before any is checkpointed; every one restored before any runs again
    assert drv.span("lock")[1] <= drv.span("checkpoint")[0]
    assert drv.span("restore")[1] <= drv.span("unlock")[0]


def test_a_checkpoint_that_fails_for_one_pid_is_undone_for_the_others(targets, socket_dir):
    drv = TimedDriver()
    drv.fail = ("checkpoint", targets[1])
    with _stub(drv, socket_dir) as stub:
        got = run_op(stub, "snapshot", "whole", "g", **_cfg(targets))
        assert got.status == sa.OPERATION_STATUS_FAILED
        assert f"pid {targets[1]}" in got.error and "OUT_OF_MEMORY" in got.error
        assert jobs(stub)["whole"][0] == sa.JOB_STATE_FAULTED
    assert all(drv.states[p] == RUNNING for p in targets)  # the others restored and unlocked
    assert sorted(p for c, p in drv.calls if c == "restore") == [targets[0], targets[2]]


def test_a_restore_that_fails_for_one_pid_leaves_it_parked_and_lets_the_others_run(targets, socket_dir):
    drv = TimedDriver()
    with _stub(drv, socket_dir) as stub:
        assert run_op(stub, "snapshot", "whole", "g", **_cfg(targets)).status == sa.OPERATION_STATUS_COMPLETE
        drv.fail = ("restore", targets[2])
        got = run_op(stub, "restore", "whole", "g")
        assert got.status == sa.OPERATION_STATUS_FAILED and f"pid {targets[2]}" in got.error
        assert jobs(stub)["whole"][0] == sa.JOB_STATE_FAULTED
    assert [drv.states[p] for p in targets] == [RUNNING, RUNNING, CHECKPOINTED]


def test_driver_state_reads_do_not_block_the_agent(targets, socket_dir):
    """cuCheckpointProcessGetState may take seconds on a busy node: the agent keeps answering meanwhile."""
    drv = TimedDriver()
    slow = threading.Event()
    plain = drv.get_state

    def get_state(pid: int) -> int:
        slow.wait(30)
        return plain(pid)

    drv.get_state = get_state  # type: ignore[method-assign]
    with _stub(drv, socket_dir) as stub:
        try:
            op = stub.Snapshot(sa.SnapshotRequest(job_id="whole", group="g", **_cfg(targets)), timeout=5)
            listed = stub.Status(sa.StatusRequest(), timeout=3)  # on the old code the loop sat in get_state
            assert {j.job_id: j.state for j in listed.job_statuses}["whole"] == sa.JOB_STATE_TRANSITIONING
        finally:
            slow.set()
        final = wait_op(stub, op.operation_id)
        assert final.status == sa.OPERATION_STATUS_COMPLETE, final.error


@pytest.mark.parametrize("bad", [0, 17, True, 1.5, "8"])
def test_parallel_must_be_a_number_of_pids_from_1_to_16(bad):
    with pytest.raises(BadBackendConfig) as info:
        CudaBackend(parallel=bad)
    assert "parallel" in str(info.value) and repr(bad) in str(info.value)
