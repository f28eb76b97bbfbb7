"""Issue 30, items 3 and 4: ``--auth-key`` means every listener, Unix sockets included; an agent without one
serves only its owner.

The attacker ran ``rota orchestrator serve --listen unix:PATH --auth-key K`` in a 1777 folder: the
socket came out ``srwxrwxrwx`` and another uid acquired and evicted with no token. Here the real
server is started the same ways: in a shared folder it refuses to start (naming the fix); in a
0700 folder its socket is 0600, a caller without a token is UNAUTHENTICATED, another uid cannot
reach it, and the victim keeps its turn.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile

import grpc
import pytest

from rota import auth
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from tests.security.agentlib import Agent, wait_op
from tests.security.procs import ROTA, attacker_rpc, clean_env, rota_calls_refused, serving


def _serve(listen: str, key_file: str) -> subprocess.Popen:
    return serving(["orchestrator", "serve", "--listen", listen, "--auth-key", key_file])[0]


@pytest.fixture
def key(tmp_path) -> tuple[str, bytes]:
    path = str(tmp_path / "auth.key")
    auth.generate_key(path)
    return path, auth.load_key(path)


def test_a_unix_socket_in_a_shared_folder_is_refused(key):
    shared = tempfile.mkdtemp(prefix="rota-1777-")
    os.chmod(shared, 0o1777)
    try:
        out = subprocess.run([*ROTA, "orchestrator", "serve", "--listen", f"unix:{shared}/o.sock", "--auth-key",
                              key[0]], env=clean_env(), capture_output=True, text=True, timeout=30)
        assert out.returncode != 0 and "mode 1777" in out.stderr and "chmod 700" in out.stderr, out.stderr
        assert not os.path.exists(f"{shared}/o.sock")
    finally:
        os.rmdir(shared)


def test_auth_key_is_checked_on_the_unix_socket(key, tmp_path):
    key_file, secret = key
    folder = tmp_path / "orch"  # made by the server, 0700
    listen = f"unix:{folder}/o.sock"
    proc = _serve(listen, key_file)
    try:
        assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(f"{folder}/o.sock").st_mode) == 0o600
        victim = pb_grpc.RotaServiceStub(auth.channel(listen, token=auth.issue(secret, group="g", job="victim")))
        grant = victim.Acquire(pb.TurnRequest(job_id="victim", group_id="g"), timeout=10)

        anonymous = pb_grpc.RotaServiceStub(grpc.insecure_channel(listen))  # same uid, no token
        rota_calls_refused(anonymous, grpc.StatusCode.UNAUTHENTICATED)
        mallory = pb_grpc.RotaServiceStub(auth.channel(listen, token=auth.issue(secret, group="g", job="mallory")))
        with pytest.raises(grpc.RpcError) as info:
            mallory.Evict(pb.EvictRequest(job_id="victim", group_id="g"), timeout=5)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

        admin = pb_grpc.RotaServiceStub(auth.channel(listen, token=auth.issue(secret, admin=True)))
        (g,) = admin.Status(pb.StatusRequest(group_id="g"), timeout=5).groups
        assert g.holder == "victim" and g.token == grant.token
    finally:
        proc.terminate()
        proc.wait(10)


def test_another_uid_cannot_reach_the_socket(key, as_attacker):
    key_file, _ = key
    base = tempfile.mkdtemp(prefix="rota-sock-")
    os.chmod(base, 0o755)  # the attacker may walk up to the server's own folder
    listen = f"unix:{base}/orch/o.sock"
    proc = _serve(listen, key_file)
    try:
        got = attacker_rpc(as_attacker, listen, "pb_grpc.RotaServiceStub",
                           'Evict(pb.EvictRequest(job_id="victim", group_id="g"), timeout=5)')
        assert got == ["UNAVAILABLE"], got  # cannot even connect
    finally:
        proc.terminate()
        proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)


def _tcp_listeners(pid: int) -> set[int]:
    """Inodes of the TCP sockets ``pid`` listens on (from /proc, as the agent itself reads them)."""
    inodes = set()
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except FileNotFoundError:  # closed since the listing (a short-lived fd): not a listener
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    listening = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}", encoding="ascii") as f:
            next(f)
            listening |= {int(line.split()[9]) for line in f if line.split()[3] == "0A"}
    return inodes & listening


def test_an_agent_without_a_key_serves_only_its_owner(agent_env, tenant, as_attacker):
    """`rota agent serve` with no --auth-key: another local uid parked or restored any job over loopback TCP
    and the 0666 socket. Now it serves no TCP port and 0600 sockets; its owner's jobs still park."""
    socket_dir = tempfile.mkdtemp(prefix="rota-sec-")
    os.chmod(socket_dir, 0o755)
    proc, _ = serving(["agent", "serve", "--socket-dir", socket_dir], agent_env, ready="rota agent serving on")
    try:
        assert _tcp_listeners(proc.pid) == set()  # no TCP port at all
        for name in ("agent.sock", "pid.sock"):
            assert stat.S_IMODE(os.stat(f"{socket_dir}/{name}").st_mode) == 0o600

        agent = Agent(None, "", socket_dir, proc)
        victim = tenant(agent, "victim")
        door = f"""
import socket
s = socket.socket(socket.AF_UNIX)
try:
    s.connect({socket_dir + "/pid.sock"!r})
    print("DOOR OPEN")
except PermissionError:
    print("door refused")
"""
        got = attacker_rpc(as_attacker, agent.unix, "sa_grpc.SnapshotAgentServiceStub",
                           'Snapshot(sa.SnapshotRequest(job_id="victim", group="g"), timeout=5)', prelude=door)
        assert got == ["door", "refused", "UNAVAILABLE"], got
        assert victim.ask("check")["parks"] == 0

        owner = sa_grpc.SnapshotAgentServiceStub(grpc.insecure_channel(agent.unix))  # the agent's own uid
        got = wait_op(owner, owner.Snapshot(sa.SnapshotRequest(job_id="victim", group="g"), timeout=10).operation_id)
        assert got.status == sa.OPERATION_STATUS_COMPLETE, got.error
        assert victim.ask("check")["parks"] == 1
    finally:
        proc.terminate()
        proc.wait(20)
        shutil.rmtree(socket_dir, ignore_errors=True)
