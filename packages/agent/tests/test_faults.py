"""A tenant that crashes mid-park leaves its job FAULTED and never blocks the group."""

from __future__ import annotations

import grpc

from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota.wire import timeslice_orchestrator_pb2 as v1a


def test_crash_mid_park_faults_job_and_group_moves_on(cluster, tenants):
    orch, agent_ep, stub = cluster
    a = tenants("--mode", "v1", "--orch", orch, "--agent", agent_ep, "--job", "crashy", "--group", "g3",
                "--crash-on-park")
    b = tenants("--mode", "v1", "--orch", orch, "--agent", agent_ep, "--job", "steady", "--group", "g3")
    a.ask("acquire")
    a.ask("release")
    got = b.ask("acquire", timeout=60)  # the park kills job crashy; steady is granted anyway
    assert got["cmd"] == "acquire"
    assert a.proc.wait(10) == 17

    with grpc.insecure_channel(agent_ep) as ch:
        st = sa_grpc.SnapshotAgentServiceStub(ch).Status(sa.StatusRequest(), timeout=5)
    assert {j.job_id: j.state for j in st.job_statuses}["crashy"] == sa.JOB_STATE_FAULTED

    status = stub.GetGroupStatus(v1a.GetGroupStatusRequest(group_id="g3"), timeout=5)
    assert status.group.locking_job == "steady"
    states = {s.job_id: s.job_state for s in status.agent_job_states}
    assert states["crashy"] == v1a.SnapshotAgentJobState.STATE_FAULTED

    b.ask("release")  # the group keeps serving
    assert b.ask("acquire", timeout=30)["cmd"] == "acquire"


def test_park_that_hangs_faults_after_deadline(tenants, child_env, tmp_path):
    from rota.orchestrator import OrchestratorConfig
    from rota.testing import running_orchestrator
    from rota_agent import Agent, running_agent

    with running_agent(Agent(op_timeout_s=1.0)) as (agent_ep, _), \
            running_orchestrator(OrchestratorConfig(ttl_s=3.0, park_timeout_s=20.0, agents=(agent_ep,))) as (orch, _):
        a = tenants("--mode", "v1", "--orch", orch, "--agent", agent_ep, "--job", "stuck", "--group", "g4",
                    "--block-on-park", str(tmp_path / "never"))
        b = tenants("--mode", "v1", "--orch", orch, "--agent", agent_ep, "--job", "next", "--group", "g4")
        a.ask("acquire")
        a.ask("release")
        assert b.ask("acquire", timeout=60)["cmd"] == "acquire"
        with grpc.insecure_channel(agent_ep) as ch:
            st = sa_grpc.SnapshotAgentServiceStub(ch).Status(sa.StatusRequest(), timeout=5)
        assert {j.job_id: j.state for j in st.job_statuses}["stuck"] == sa.JOB_STATE_FAULTED
