"""A registration's /proc reads (which process the channel is, which ports it owns) run on a worker thread: a
registration stuck in them leaves the agent serving everyone else.

The agent is the real one, served in this process; its /proc read is made to wait on an event (a node whose
/proc answers slowly, or a caller whose checks are costly), since no real /proc here is slow on demand.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from rota.wire import snapshot_agent_pb2 as sa
from rota_agent import WorkloadClient, _registration


def test_a_registration_held_in_its_proc_reads_does_not_stall_the_agent(agent, agent_stub, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    real = _registration._proven_pid

    def slow_proc(job_id: str, proof, claim: int) -> tuple[int, int]:
        entered.set()
        assert release.wait(60), "the test never released the registration"
        return real(job_id, proof, claim)

    monkeypatch.setattr(_registration, "_proven_pid", slow_proc)
    slow = WorkloadClient(agent[0], "slow", "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None)
    try:
        assert entered.wait(30), "the registration never reached its /proc reads"
        # the agent answers while that registration waits: Status, and another job's whole registration
        assert agent_stub.Status(sa.StatusRequest(), timeout=10).job_statuses == []
        monkeypatch.setattr(_registration, "_proven_pid", real)
        other = WorkloadClient(agent[0], "other", "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None)
        try:
            other.wait_registered(10)
            assert [j.job_id for j in agent_stub.Status(sa.StatusRequest(), timeout=10).job_statuses] == ["other"]
        finally:
            other.close()
        release.set()
        slow.wait_registered(10)
        assert "slow" in {j.job_id for j in agent_stub.Status(sa.StatusRequest(), timeout=10).job_statuses}
    finally:
        release.set()
        slow.close()


def test_a_caller_without_the_right_is_refused_before_any_proc_read(agent, monkeypatch):
    """vet (ids, right, backend, endpoints) runs before prove: a refused caller costs the agent no /proc read."""
    reads: list[str] = []
    monkeypatch.setattr(_registration, "_proven_pid", lambda job_id, proof, claim: reads.append(job_id) or (0, 0))
    client = WorkloadClient(agent[0], "j1", "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None,
                            backend="no-such-backend")
    try:
        with pytest.raises(Exception) as info:
            client.wait_registered(10)
        assert getattr(info.value, "code", None) == grpc.StatusCode.INVALID_ARGUMENT, info.value
        assert "no-such-backend" in str(info.value) and reads == []
    finally:
        client.close()
