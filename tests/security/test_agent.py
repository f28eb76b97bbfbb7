"""Issue 17, rows 13-16: attacks on the node agent, each driven against a real ``rota agent serve`` process.

The agent runs as ``rota agent serve --auth-key KEY`` (the orchestrator's key) on loopback TCP, with
its Unix sockets (``agent.sock`` and the pid door ``pid.sock``) in a private directory. Tenants are
real processes (``packages/agent/tests/tenant_proc.py``) that register through the pid door with
their job's token. ``victim`` and ``mallory`` are jobs of group ``g``; the attacker holds a valid
token for ``mallory`` only (another team on the same node); the orchestrator holds an admin token.
Each test shows the attack is refused and that the victim's registration and state are unchanged.

No fakes: this machine has no GPU, so the cuda backend finds no CUDA driver. The agent refuses a
pid that is not the job's own before it looks for one, which is what rows 13 and 14 are about.
"""

from __future__ import annotations

import json
import os
import queue
import socket
import sys
import time
from collections.abc import Iterator

import grpc
import pytest

from rota.types import ParkResult
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import WorkloadClient
from rota_agent_client.extension import ext, read
from tests.security.agentlib import (
    PERMISSION_DENIED,
    UNAUTHENTICATED,
    cuda,
    no_such_pid,
    refused,
    registered,
    registration_refused,
    states,
    wait_op,
)

# ------------------------------------------------------------------------------------------- row 13


def test_row13_snapshot_of_pids_the_job_did_not_prove_is_refused_alike(start_agent, tenant):
    agent = start_agent()
    victim, mallory = tenant(agent, "victim"), tenant(agent, "mallory")
    admin, attacker = agent.admin(), agent.stub(agent.token("mallory"))
    before = states(admin)
    assert before == {"victim": "JOB_STATE_IDLE", "mallory": "JOB_STATE_IDLE"}

    answers = set()
    for stub in (attacker, admin):  # not even the orchestrator may name a pid the job did not prove
        for pid in (victim.ready["pid"], no_such_pid(), 1):
            code, details = refused(stub.Snapshot, cuda("mallory", pid))
            assert code == PERMISSION_DENIED, details
            answers.add(details.replace(str(pid), "PID"))
    assert len(answers) == 1, answers  # the same words for a live and a missing pid: no pid oracle

    code, _ = refused(attacker.Snapshot, cuda("victim", victim.ready["pid"]))
    assert code == PERMISSION_DENIED  # the victim's job is not the attacker's to name
    assert refused(agent.stub().Snapshot, cuda("mallory", victim.ready["pid"]))[0] == UNAUTHENTICATED

    try:  # the job's own process passes the check; this machine then has no CUDA driver to park it with
        attacker.Snapshot(cuda("mallory", mallory.ready["pid"]), timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() != PERMISSION_DENIED, exc.details()

    assert {k: v for k, v in states(admin).items() if k == "victim"} == {"victim": "JOB_STATE_IDLE"}
    check = victim.ask("check")
    assert check["parks"] == 0 and check["on_device"]


# ------------------------------------------------------------------------------------------- row 14


def test_row14_a_second_registration_cannot_replace_the_victim_or_claim_its_pid(start_agent, tenant):
    agent = start_agent()
    victim = tenant(agent, "victim")
    vpid = victim.ready["pid"]

    for target in (agent.tcp, agent.unix):
        code, details = registration_refused(target, "victim", agent.token("mallory"), rota_backend="noop")
        assert code == PERMISSION_DENIED and "victim" in details
        code, _ = registration_refused(target, "victim", "", rota_backend="cuda", rota_pid=str(vpid))
        assert code == UNAUTHENTICATED

    # mallory registers its own job through the pid door, for the cuda backend, claiming the victim's pid
    tenant(agent, "mallory", "--backend", "cuda", "--claim-pid", str(vpid))
    admin = agent.admin()
    code, _ = refused(admin.Snapshot, cuda("mallory", vpid))
    assert code == PERMISSION_DENIED  # the claim tied nothing: mallory's pid is its own process only

    # the victim's registration is intact: a snapshot still reaches its own process
    got = wait_op(admin, admin.Snapshot(sa.SnapshotRequest(job_id="victim", group="g"), timeout=10).operation_id)
    assert got.status == sa.OPERATION_STATUS_COMPLETE, got.error
    check = victim.ask("check")
    assert check["parks"] == 1 and not check["on_device"] and check["identical"]
    assert states(admin)["victim"] == "JOB_STATE_SAVED"
    got = wait_op(admin, admin.Restore(sa.RestoreRequest(job_id="victim", group="g"), timeout=10).operation_id)
    assert got.status == sa.OPERATION_STATUS_COMPLETE and victim.ask("check")["on_device"]


def test_row14_without_tokens_another_uid_cannot_join_the_victims_job(start_agent, tenant, as_attacker):
    agent = start_agent(keyed=False)  # loopback, no key: callers are told apart by the uid the door proves
    victim = tenant(agent, "victim")
    code = f"""
import json, time
from rota_agent import WorkloadClient
c = WorkloadClient({agent.unix!r}, "victim", "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None,
                   backend="noop", pid={victim.ready["pid"]})
for _ in range(200):
    if c.error is not None:
        break
    time.sleep(0.05)
print(json.dumps({{"code": c.error.code.name if c.error else None, "text": str(c.error)}}))
c.close()
"""
    done = as_attacker(code, env={"PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer["code"] == "PERMISSION_DENIED" and "another owner" in answer["text"], answer
    admin = agent.admin()
    got = wait_op(admin, admin.Snapshot(sa.SnapshotRequest(job_id="victim", group="g"), timeout=10).operation_id)
    assert got.status == sa.OPERATION_STATUS_COMPLETE and victim.ask("check")["parks"] == 1


# ------------------------------------------------------------------------------------------- row 15


def test_row15_app_endpoint_calls_only_registered_urls_without_redirects_or_bodies(start_agent, http_servers):
    agent = start_agent("--http-timeout", "5")
    internal = http_servers(lambda path: (200, {}, b"INTERNAL-SECRET"))  # e.g. a metadata service
    mode = {"answer": (302, {"Location": internal.url + "/latest/meta-data"}, b"")}
    own = http_servers(lambda path: mode["answer"])  # the attacker's own server
    client = registered(agent, "mallory", app=sa.APP_VLLM, endpoints=[own.url])
    attacker = agent.stub(agent.token("mallory"))
    try:
        for url in (internal.url + "/any/path", "http://127.0.0.1:1", "http://169.254.169.254"):
            req = sa.SnapshotRequest(job_id="mallory", group="g", backend_config=sa.BackendConfig(
                app_endpoint=sa.AppEndpointConfig(app=sa.APP_VLLM, endpoints=[url])))
            code, details = refused(attacker.Snapshot, req)
            assert code == PERMISSION_DENIED and "not one the job registered" in details
        victim_req = sa.SnapshotRequest(job_id="victim", group="g", backend_config=sa.BackendConfig(
            app_endpoint=sa.AppEndpointConfig(app=sa.APP_VLLM, endpoints=[internal.url])))
        assert refused(attacker.Snapshot, victim_req)[0] == PERMISSION_DENIED

        own_req = sa.SnapshotRequest(job_id="mallory", group="g", backend_config=sa.BackendConfig(
            app_endpoint=sa.AppEndpointConfig()))
        got = wait_op(attacker, attacker.Snapshot(own_req, timeout=10).operation_id)
        assert got.status == sa.OPERATION_STATUS_FAILED and "HTTP 302" in got.error, got.error
        assert own.calls == ["POST /sleep?level=1"]  # the redirect was an answer, not a new URL to call

        mode["answer"] = (404, {}, b"INTERNAL-SECRET in a 404 body")
        got = wait_op(attacker, attacker.Snapshot(own_req, timeout=10).operation_id)
        assert got.status == sa.OPERATION_STATUS_FAILED and "HTTP 404" in got.error
        assert "SECRET" not in got.error and len(got.error) < 300
        assert internal.calls == []
    finally:
        client.close()


# ------------------------------------------------------------------------------------------- row 16


def test_row16_status_stays_bounded_and_answers_while_endpoints_hang(start_agent, http_servers):
    agent = start_agent("--op-timeout", "3", "--http-timeout", "5", "--forget-after", "1")
    admin = agent.admin()
    group_token = agent.token("*", "g2")  # a service's token for any job of its group

    huge = WorkloadClient(agent.tcp, "huge", "g2", on_snapshot=lambda *_: None, on_restore=lambda *_: None,
                          token=group_token, proof="", app=sa.APP_VLLM,
                          endpoints=["http://127.0.0.1:8000/" + "a" * (3 << 20)])
    try:
        with pytest.raises(Exception) as info:
            huge.wait_registered(20)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and len(str(info.value)) < 600
    finally:
        huge.close()

    residue = {f"untracked:t{i}": 1 << 20 for i in range(5000)}

    def loud_failure(*_: object) -> None:
        exc = RuntimeError("x" * (1 << 20) + "\n2024-01-01 INFO rota: fake log line")
        exc.park_result = ParkResult(residue=residue)  # type: ignore[attr-defined]
        raise exc

    loud = registered(agent, "loud", group="g2", token=group_token, on_snapshot=loud_failure)
    silent = socket.socket()  # accepts connections (kernel backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    hung_url = f"http://127.0.0.1:{silent.getsockname()[1]}"
    slow = [registered(agent, f"slow-{i}", group="g2", token=group_token, app=sa.APP_VLLM, endpoints=[hung_url],
                       backend="app_endpoint") for i in range(12)]
    fast_server = http_servers(lambda path: (200, {"Content-Type": "application/json"},
                                             b'{"is_sleeping": true}' if "is_sleeping" in path else b"{}"))
    fast = registered(agent, "fast", app=sa.APP_VLLM, endpoints=[fast_server.url], backend="app_endpoint")
    try:
        got = wait_op(admin, admin.Snapshot(sa.SnapshotRequest(job_id="loud", group="g2"), timeout=10).operation_id)
        assert got.status == sa.OPERATION_STATUS_FAILED and len(got.error) <= 1000 and "\n" not in got.error

        ops = [admin.Snapshot(sa.SnapshotRequest(job_id=f"slow-{i}", group="g2"), timeout=10).operation_id
               for i in range(12)]
        t0 = time.monotonic()
        st = admin.Status(sa.StatusRequest(), timeout=2.0)  # the orchestrator's deadline
        assert time.monotonic() - t0 < 2.0
        assert st.ByteSize() < 64 << 10, st.ByteSize()
        by_job = {j.job_id: j for j in st.job_statuses}
        assert set(by_job) == {"loud", "fast", *(f"slow-{i}" for i in range(12))}
        more = read(by_job["loud"], ext.JobStatusExt)
        assert len(more.fault) <= 1000 and len(more.residue.bytes) <= 32
        assert more.residue.counted_bytes == len(residue) << 20  # bounded, yet every byte still counts

        fast_op = admin.Snapshot(sa.SnapshotRequest(job_id="fast", group="g"), timeout=10).operation_id
        got = wait_op(admin, fast_op, within=2.5)  # not starved: the hung calls hold their threads for 5 s
        assert got.status == sa.OPERATION_STATUS_COMPLETE, got.error
        assert fast_server.calls[0] == "POST /sleep?level=1"

        for op in ops:  # every hung operation ends on its own deadline
            got = wait_op(admin, op, within=10)
            assert got.status == sa.OPERATION_STATUS_FAILED and len(got.error) < 400, got.error
    finally:
        for c in (loud, *slow, fast):
            c.close()
        silent.close()

    deadline = time.monotonic() + 15
    while states(admin) and time.monotonic() < deadline:  # finished jobs are collected
        time.sleep(0.1)
    assert states(admin) == {}


def test_agent_serves_unmodified_v1alpha1_registrations_on_loopback_without_key(start_agent):
    """Wire compatibility: without --auth-key a plain v1alpha1 client (no metadata) still registers on loopback."""
    agent = start_agent(keyed=False)
    q: queue.Queue = queue.Queue()

    def messages() -> Iterator[sa.WorkloadMessage]:
        yield sa.WorkloadMessage(register=sa.RegisterWorkload(job_id="plain", group="g"))
        while (cmd := q.get()) is not None:
            yield cmd

    with grpc.insecure_channel(agent.tcp) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        call = stub.WorkloadChannel(messages())
        for _ in range(100):
            if "plain" in states(stub):
                break
            time.sleep(0.05)
        op = stub.Snapshot(sa.SnapshotRequest(job_id="plain", group="g"), timeout=10).operation_id
        cmd = next(call)
        q.put(sa.WorkloadMessage(result=sa.CommandResult(command_id=cmd.command_id, ok=True)))
        assert wait_op(stub, op).status == sa.OPERATION_STATUS_COMPLETE
        q.put(None)
        call.cancel()
