"""Issue 30, item 1: the node agent calls only the job's own server.

A tenant (``mallory``, with a valid token for its own job only) registers its job with
``app_endpoint`` URLs of its choice and asks for snapshots, as the attacker did against
``rota agent serve --auth-key`` on loopback: to scan ports, to read a service's first line
back through ``GetOperation.error``, and to tie up the agent's HTTP threads. Each test
checks the refusal and that nothing was harmed (the foreign service saw no connection,
another job's snapshot still runs at once).

The registering process is this test process (it proves its pid through the agent's door),
so the HTTP servers it starts here are its own; a foreign service is a separate process.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import grpc
import pytest

from rota.wire import snapshot_agent_pb2 as sa
from tests.security.agentlib import PERMISSION_DENIED, registered, wait_op

FOREIGN = r"""
import os, socket, sys
if os.fork():  # not a descendant of the test process: not the job's
    os._exit(0)
s = socket.socket()
s.bind(("127.0.0.1", 0))
s.listen(16)
print(s.getsockname()[1], os.getpid(), flush=True)
while True:
    c, _ = s.accept()
    print("ACCEPTED", flush=True)
    c.sendall(b"+OK redis ready AUTH token=SECRET-1234 requirepass=hunter2\r\n")
    c.close()
"""


@pytest.fixture
def foreign():
    """A service of another process (another tenant's, or a node daemon) that speaks first; (port, its output)."""
    proc = subprocess.Popen([sys.executable, "-c", FOREIGN], stdout=subprocess.PIPE, text=True)
    port, pid = map(int, proc.stdout.readline().split())  # type: ignore[union-attr]
    proc.wait()
    yield port, lambda: (os.kill(pid, signal.SIGKILL), proc.communicate()[0])[1]
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def refusal(agent, job: str, url: str) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(Exception) as info:
        registered(agent, job, app=sa.APP_VLLM, endpoints=[url]).close()
    return info.value.code, str(info.value)


def test_a_port_the_job_does_not_own_is_refused_at_registration_without_an_oracle(start_agent, foreign):
    agent = start_agent("--http-timeout", "5")
    port, output = foreign
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    free = closed.getsockname()[1]
    closed.close()  # nobody listens there

    answers = set()
    for url, p in ((f"http://127.0.0.1:{port}", port), (f"http://localhost:{port}", port),
                   (f"http://127.0.0.1:{free}", free)):
        code, text = refusal(agent, "mallory", url)
        assert code == PERMISSION_DENIED and "does not listen there" in text, text
        answers.add(text.replace(str(p), "PORT").replace("localhost", "127.0.0.1"))
    assert len(answers) == 1, answers  # a foreign listener and a closed port read alike: no port scan
    assert agent.admin().Status(sa.StatusRequest(), timeout=5).job_statuses == []
    time.sleep(0.2)
    assert "ACCEPTED" not in output()  # the agent never connected to it


@pytest.mark.parametrize("host", ["127.1", "2130706433", "0x7f000001", "0177.0.0.1", "example.com"])
def test_other_spellings_of_an_address_are_refused(start_agent, http_servers, host):
    agent = start_agent()
    own = http_servers(lambda path: (200, {}, b"{}"))
    code, text = refusal(agent, "mallory", f"http://{host}:{own.server_address[1]}")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "canonical" in text, text
    assert own.calls == []


def test_a_first_line_read_back_is_a_fixed_category(start_agent):
    """The job's own port, speaking first like Redis: the error names a category, never the line."""
    agent = start_agent("--http-timeout", "5")
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"

    def speak() -> None:
        while True:
            try:
                c, _ = srv.accept()
            except OSError:
                return
            c.sendall(b"+OK redis ready AUTH token=SECRET-1234 requirepass=hunter2\r\n")
            c.settimeout(5)
            with contextlib.suppress(OSError):  # take the request before closing: closing on unread bytes
                c.recv(65536)  # resets the connection, and the client may see the reset before the line
            c.close()

    threading.Thread(target=speak, daemon=True).start()
    client = registered(agent, "mallory", app=sa.APP_VLLM, endpoints=[url], backend="app_endpoint")
    attacker = agent.stub(agent.token("mallory"))
    try:
        op = attacker.Snapshot(sa.SnapshotRequest(job_id="mallory", group="g"), timeout=10).operation_id
        got = wait_op(attacker, op)
        assert got.status == sa.OPERATION_STATUS_FAILED
        assert "did not answer in HTTP" in got.error and "SECRET" not in got.error and "+OK" not in got.error, \
            got.error
    finally:
        client.close()
        srv.close()


def test_silent_endpoints_of_one_job_do_not_hold_the_agent(start_agent, http_servers):
    """Eight silent servers of one job (the old code's eight threads) leave another job's snapshot prompt."""
    agent = start_agent("--op-timeout", "20", "--http-timeout", "5")
    silent = []
    for _ in range(8):
        s = socket.socket()  # accepts (kernel backlog) and never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        silent.append(s)
    urls = [f"http://127.0.0.1:{s.getsockname()[1]}" for s in silent]
    urls += [u.replace("127.0.0.1", "localhost") for u in urls]  # another spelling: the same eight servers
    fast_server = http_servers(lambda path: (200, {"Content-Type": "application/json"},
                                             b'{"is_sleeping": true}' if "is_sleeping" in path else b"{}"))
    slow = registered(agent, "mallory", app=sa.APP_VLLM, endpoints=urls, backend="app_endpoint")
    fast = registered(agent, "victim", app=sa.APP_VLLM, endpoints=[fast_server.url], backend="app_endpoint")
    attacker, admin = agent.stub(agent.token("mallory")), agent.admin()
    try:
        slow_op = attacker.Snapshot(sa.SnapshotRequest(job_id="mallory", group="g"), timeout=10).operation_id
        time.sleep(0.5)  # the silent calls hold their threads now
        got = wait_op(admin, admin.Snapshot(sa.SnapshotRequest(job_id="victim", group="g"),
                                            timeout=10).operation_id, within=3.0)  # the hung calls take 5 s
        assert got.status == sa.OPERATION_STATUS_COMPLETE, got.error
        assert fast_server.calls[0] == "POST /sleep?level=1"
        got = wait_op(attacker, slow_op, within=30)
        assert got.status == sa.OPERATION_STATUS_FAILED and "timed out" in got.error, got.error
    finally:
        slow.close()
        fast.close()
        for s in silent:
            s.close()


SETUID_CHILD = """
import json, subprocess, time, grpc
from rota.wire import snapshot_agent_pb2 as sa, snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import WorkloadClient
child = subprocess.Popen([{sleeper!r}, "60"])  # setuid root: the attacker's child, running with root's rights
time.sleep(0.5)
client = WorkloadClient({unix!r}, "mallory", "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None,
                        backend="cuda", pid=child.pid)
client.wait_registered()
stub = sa_grpc.SnapshotAgentServiceStub(grpc.insecure_channel({tcp!r}))
req = sa.SnapshotRequest(job_id="mallory", group="g", backend_config=sa.BackendConfig(
    cuda=sa.CudaBackendConfig(explicit_target=sa.ProcessTarget(pids=[child.pid]))))
try:
    stub.Snapshot(req, timeout=10)
    print("ACCEPTED")
except grpc.RpcError as exc:
    print(exc.code().name)
child.kill()
client.close()
"""


def test_a_setuid_child_is_not_the_tenants_process(start_agent, as_attacker, tmp_path):
    """The attacker registers its job claiming (rota-pid) a setuid-root child of its own; the child is not its."""
    agent = start_agent(keyed=False)  # uids told apart by the pid door; --insecure TCP: everyone may ask
    folder = tempfile.mkdtemp(prefix="rota-suid-")
    os.chmod(folder, 0o755)
    sleeper = os.path.join(folder, "sleep")
    shutil.copy("/bin/sleep", sleeper)
    os.chown(sleeper, 0, 0)
    os.chmod(sleeper, 0o4755)
    try:
        done = as_attacker(SETUID_CHILD.format(sleeper=sleeper, unix=agent.unix, tcp=agent.tcp),
                           env={"PYTHONPATH": os.pathsep.join(sys.path)})
        assert done.returncode == 0, done.stderr
        assert done.stdout.split()[-1] == "PERMISSION_DENIED", done.stdout
    finally:
        shutil.rmtree(folder, ignore_errors=True)
