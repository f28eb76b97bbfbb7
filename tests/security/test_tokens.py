"""Issue 30, item 2: tokens by audience, the agent link's TLS, and priorities bounded by the token.

The attacker stands at an ``--agent`` address of a real ``rota orchestrator serve --auth-key``
(or sniffs that link) and replays what the orchestrator shows its agents; or holds a valid
token for its own job only and asks for a priority that jumps the queue. Each test checks the
refusal and that the victim still holds its group.
"""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import threading
import time

import grpc
import jwt
import pytest

import rota
from rota import auth
from rota.orchestrator import OrchestratorConfig
from rota.testing import free_port, running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import timeslice_orchestrator_pb2 as v1a
from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc
from rota_agent import WorkloadClient
from tests.security.agentlib import states
from tests.security.procs import ROTA, clean_env, rota_calls_refused, serving
from tests.security.test_tls import pki  # noqa: F401  (fixture: a test CA and certificates for 127.0.0.1)


class Sniffer(grpc.GenericRpcHandler):
    """What the attacker runs at an --agent address: a gRPC server that records every call's metadata."""

    def __init__(self) -> None:
        self.seen: list[dict[str, str]] = []

    def service(self, details):  # type: ignore[no-untyped-def]
        self.seen.append(dict(details.invocation_metadata))
        return None  # UNIMPLEMENTED


def _orchestrator(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return serving(["orchestrator", "serve", *args], clean_env(**(env or {})))[0]


def _group_status(endpoint: str, token: str, group: str = "g") -> v1a.GetGroupStatusResponse:
    stub = v1a_grpc.TimeSliceOrchestratorServiceStub(auth.channel(endpoint, token=token))
    return stub.GetGroupStatus(v1a.GetGroupStatusRequest(group_id=group), timeout=10)


def test_the_token_an_agent_is_shown_acts_nowhere_else(tmp_path, start_agent):
    """What the orchestrator shows the agent at one --agent address (the attacker's, or read off that plaintext
    link) is refused by the orchestrator and, since issue 45 row 8, by every other agent of the same key: it names
    the agent it is for. (Replayed at another agent it parked that agent's victim: Snapshot -> COMPLETE.)"""
    other = start_agent()  # a real agent of the same key, on another address, with the victim registered
    key_file = str(tmp_path / "key0")  # start_agent's key, the orchestrator's too
    key = auth.load_key(key_file)
    sniffer = Sniffer()
    fake_agent = grpc.server(concurrent.futures.ThreadPoolExecutor(2), handlers=[sniffer])
    agent_port = fake_agent.add_insecure_port("127.0.0.1:0")
    fake_agent.start()
    port = free_port()
    endpoint = f"127.0.0.1:{port}"
    orch = _orchestrator(["--listen", endpoint, "--auth-key", key_file, "--agent", f"127.0.0.1:{agent_port}"])
    victim = rota.connect(group="g", tenant="victim", endpoint=endpoint, token=auth.issue(key, group="g", job="victim"))
    parked = threading.Event()
    tenant = WorkloadClient(other.unix, "victim", "g", on_snapshot=lambda *_: parked.set(),
                            on_restore=lambda *_: None, token=other.token("victim"), proof="").wait_registered()
    try:
        victim.acquire()
        _group_status(endpoint, auth.issue(key, admin=True))  # the orchestrator asks its agents for their jobs
        stolen = [m["authorization"].partition(" ")[2] for m in sniffer.seen if "authorization" in m]
        assert stolen, sniffer.seen
        claims = jwt.decode(stolen[-1], options={"verify_signature": False})
        assert claims["aud"] == auth.AGENT_AUDIENCE and claims["exp"] - claims["iat"] <= 60, claims

        rogue = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=stolen[-1]))
        for details in rota_calls_refused(rogue, grpc.StatusCode.UNAUTHENTICATED):
            assert "another kind of server" in details
        assert _group_status(endpoint, auth.issue(key, admin=True)).group.locking_job == "victim"
        replayed = other.stub(stolen[-1])
        with pytest.raises(grpc.RpcError) as info:
            replayed.Snapshot(sa.SnapshotRequest(job_id="victim", group="g"), timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
        assert f"is for agent 127.0.0.1:{agent_port}, not this one" in info.value.details()
        assert "--name" in info.value.details()
        assert not parked.wait(0.5)  # the victim was never told to park
        assert states(other.admin())["victim"] != "JOB_STATE_SAVED"
        assert claims["rota_agent"] == f"127.0.0.1:{agent_port}", claims  # the one agent it is for
        victim.release()
    finally:
        tenant.close()
        victim.close()
        orch.terminate()
        orch.wait(10)
        fake_agent.stop(0)
    with pytest.raises(Exception, match="at most 60"):
        auth.issue(key, admin=True, audience=auth.AGENT_AUDIENCE, ttl_s=600)
    with pytest.raises(Exception, match="names the one agent it is for"):
        auth.issue(key, admin=True, audience=auth.AGENT_AUDIENCE, ttl_s=60)


def test_a_plaintext_agent_link_is_warned_about(tmp_path):
    """Issue 45 row 8: tokens on the default plaintext agent link could be read; without TLS the orchestrator
    says so at start, naming the link and the fix."""
    key_file = str(tmp_path / "auth.key")
    auth.generate_key(key_file)
    proc, lines = serving(["orchestrator", "serve", "--listen", f"127.0.0.1:{free_port()}", "--auth-key", key_file,
                           "--agent", "10.255.255.1:9001", "--agent", "127.0.0.1:9001"], clean_env())
    try:
        said = "".join(lines)
        assert "WARNING: the link to agent 10.255.255.1:9001 is plaintext" in said and "--tls-cert" in said, said
        assert "agent 127.0.0.1:9001 is plaintext" not in said  # loopback does not leave the host
    finally:
        proc.terminate()
        proc.wait(10)


def test_an_orchestrator_with_tls_talks_to_its_agents_only_over_tls(tmp_path, pki):  # noqa: F811
    key_file = str(tmp_path / "auth.key")
    auth.generate_key(key_file)
    listener = socket.socket()  # the attacker's plaintext listener at the --agent address records the bytes
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    got: list[bytes] = []

    def record() -> None:
        conn, _ = listener.accept()
        conn.settimeout(5)
        with conn:
            try:
                got.append(conn.recv(4096))
            except OSError:
                got.append(b"")

    threading.Thread(target=record, daemon=True).start()
    tls = ["--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key")]
    args = ["--listen", f"127.0.0.1:{free_port()}", "--auth-key", key_file, *tls,
            "--agent", f"127.0.0.1:{listener.getsockname()[1]}"]
    refused = subprocess.run([*ROTA, "orchestrator", "serve", *args], env=clean_env(), capture_output=True, text=True,
                             timeout=30)
    assert refused.returncode != 0 and "ROTA_TLS_CA" in refused.stderr, refused.stderr  # never plaintext

    orch = _orchestrator(args, {"ROTA_TLS_CA": str(pki / "ca.pem")})
    try:
        key = auth.load_key(key_file)
        os.environ["ROTA_TLS_CA"] = str(pki / "ca.pem")
        try:
            victim = pb_grpc.RotaServiceStub(auth.channel(args[1], token=auth.issue(key, group="g", job="victim")))
            victim.Acquire(pb.TurnRequest(job_id="victim", group_id="g"), timeout=10)
            _group_status(args[1], auth.issue(key, admin=True))
        finally:
            os.environ.pop("ROTA_TLS_CA")
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got and got[0][:1] == b"\x16", got  # a TLS handshake record, nothing readable
        assert b"Bearer" not in got[0] and b"authorization" not in got[0]
    finally:
        orch.terminate()
        orch.wait(10)
        listener.close()


def test_a_tls_agent_takes_the_orchestrators_short_token(tmp_path, pki, start_agent):  # noqa: F811
    """The working path: a real agent with --tls-cert and --auth-key answers the TLS orchestrator's Status."""
    agent = start_agent("--tls-cert", str(pki / "server.pem"), "--tls-key", str(pki / "server.key"))
    key_file = str(tmp_path / "key0")  # the agent's key (start_agent made it), shared with the orchestrator
    endpoint = f"127.0.0.1:{free_port()}"
    orch = _orchestrator(["--listen", endpoint, "--auth-key", key_file, "--tls-cert", str(pki / "server.pem"),
                          "--tls-key", str(pki / "server.key"), "--agent", agent.tcp],
                         {"ROTA_TLS_CA": str(pki / "ca.pem")})
    tenant = WorkloadClient(agent.unix, "victim", "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None,
                            token=agent.token("victim"), proof="").wait_registered()
    os.environ["ROTA_TLS_CA"] = str(pki / "ca.pem")
    try:
        victim = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=agent.token("victim")))
        victim.Acquire(pb.TurnRequest(job_id="victim", group_id="g"), timeout=10)
        states = _group_status(endpoint, agent.token(admin=True)).agent_job_states
        assert [(s.agent, s.job_id) for s in states] == [(agent.tcp, "victim")], states
        out = subprocess.run([*ROTA, "agent", "status", "--agent", agent.tcp, "--json"], capture_output=True,
                             text=True, timeout=60, env=clean_env(ROTA_TLS_CA=str(pki / "ca.pem"),
                                                                  ROTA_TOKEN=agent.token(admin=True),
                                                                  ROTA_LOAD_PLUGINS="rota-agent"))
        assert out.returncode == 0 and '"job_id": "victim"' in out.stdout, out.stderr  # the operator's view, TLS
    finally:
        os.environ.pop("ROTA_TLS_CA")
        tenant.close()
        orch.terminate()
        orch.wait(10)


def test_priority_above_zero_needs_a_token_that_allows_it(tmp_path):
    key_file = str(tmp_path / "auth.key")
    auth.generate_key(key_file)
    key = auth.load_key(key_file)
    issued = subprocess.run([*ROTA, "token", "issue", "--auth-key", key_file, "--group", "g", "--job", "boss",
                             "--max-priority", "5"], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert issued.returncode == 0, issued.stderr
    boss_token = issued.stdout.strip()
    with running_orchestrator(OrchestratorConfig(ttl_s=3.0), auth=auth.ServerAuth(key=key)) as (endpoint, engine):
        victim = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(key, group="g", job="victim")))
        grant = victim.Acquire(pb.TurnRequest(job_id="victim", group_id="g"), timeout=5)
        mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(key, group="g", job="mallory")))
        for prio in (1, 1000):
            with pytest.raises(grpc.RpcError) as info:
                mallory.Acquire(pb.TurnRequest(job_id="mallory", group_id="g", priority=prio), timeout=5)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "--max-priority" in info.value.details()
        boss = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=boss_token))
        with pytest.raises(grpc.RpcError) as info:
            boss.Acquire(pb.TurnRequest(job_id="boss", group_id="g", priority=6), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        g = engine.groups["g"]
        assert g.holder == "victim" and g.queued("mallory") is None and g.queued("boss") is None
        with pytest.raises(grpc.RpcError) as info:  # the allowed priority queues (behind the holder)
            boss.Acquire(pb.TurnRequest(job_id="boss", group_id="g", priority=5), timeout=0.5)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        victim.Release(pb.ReleaseRequest(job_id="victim", group_id="g", token=grant.token), timeout=5)
        got = boss.Acquire(pb.TurnRequest(job_id="boss", group_id="g", priority=5), timeout=5)
        assert got.token > grant.token
