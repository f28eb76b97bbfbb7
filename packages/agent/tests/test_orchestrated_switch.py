"""A tenant registered over WorkloadChannel is parked and restored by orchestrator-driven commands."""

from __future__ import annotations

import grpc

from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota.wire import timeslice_orchestrator_pb2 as v1a


def _agent_states(agent_ep: str) -> dict[str, str]:
    with grpc.insecure_channel(agent_ep) as ch:
        st = sa_grpc.SnapshotAgentServiceStub(ch).Status(sa.StatusRequest(), timeout=5)
    return {j.job_id: sa.JobState.Name(j.state) for j in st.job_statuses}


def test_agent_parks_outgoing_and_restores_incoming(cluster, tenants):
    orch, agent_ep, stub = cluster
    a = tenants("--mode", "gpu", "--orch", orch, "--agent", agent_ep, "--job", "job-a", "--group", "g1")
    b = tenants("--mode", "gpu", "--orch", orch, "--agent", agent_ep, "--job", "job-b", "--group", "g1")

    assert a.ask("acquire")["restored"] is False
    assert a.ask("release")["deferred"] is True  # nobody waits: nothing parked

    got = b.ask("acquire", timeout=60)  # the agent must park job-a first
    assert got["restored"] is False
    check = a.ask("check")
    assert check["parks"] == 1 and check["on_device"] is False and check["identical"]
    assert check["agent_commands"] == ["snapshot"]
    assert _agent_states(agent_ep)["job-a"] == "JOB_STATE_SAVED"
    b.ask("release")

    back = a.ask("acquire", timeout=60)  # agent parks job-b and restores job-a before the grant
    assert back["restored"] is True and back["on_device"] is True
    check = a.ask("check")
    assert check["restores"] == 1 and check["identical"]
    assert check["agent_commands"] == ["snapshot", "restore"]
    assert b.ask("check")["agent_commands"] == ["snapshot"]

    status = stub.GetGroupStatus(v1a.GetGroupStatusRequest(group_id="g1"), timeout=5)
    assert status.group.locking_job == "job-a" and status.group.loaded_job == "job-a"
    states = {s.job_id: v1a.SnapshotAgentJobState.State.Name(s.job_state) for s in status.agent_job_states}
    assert states == {"job-a": "STATE_RUNNING", "job-b": "STATE_SAVED"}
    assert all(s.agent == agent_ep for s in status.agent_job_states)


def test_v1alpha1_tenant_without_session_is_parked_by_agent(cluster, tenants):
    orch, agent_ep, _ = cluster
    a = tenants("--mode", "v1", "--orch", orch, "--agent", agent_ep, "--job", "va", "--group", "g2")
    b = tenants("--mode", "v1", "--orch", orch, "--agent", agent_ep, "--job", "vb", "--group", "g2")
    a.ask("acquire")
    a.ask("release")
    b.ask("acquire", timeout=60)
    assert a.ask("check")["parks"] == 1
    b.ask("release")
    back = a.ask("acquire", timeout=60)
    assert back["restored"] is True and back["on_device"] is True
    assert b.ask("check")["parks"] == 1
