"""The node agent as the security tests drive it: a real ``rota agent serve`` process, tenants, HTTP servers.

Helpers the agent's security tests share; the fixtures built on them (``start_agent``, ``tenant``,
``http_servers``) are tests/security/conftest.py's.
"""

from __future__ import annotations

import http.server
import os
import pathlib
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from rota import auth
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import WorkloadClient

ROOT = pathlib.Path(__file__).resolve().parents[2]
TENANT = str(ROOT / "packages/agent/tests/tenant_proc.py")
ROTA = os.path.join(os.path.dirname(sys.executable), "rota")
PERMISSION_DENIED, UNAUTHENTICATED = grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED


class Agent:
    """A ``rota agent serve`` subprocess and how to reach it."""

    def __init__(self, key: bytes | None, tcp: str, socket_dir: str, proc: subprocess.Popen) -> None:
        self.key, self.tcp, self.dir, self.proc = key, tcp, socket_dir, proc
        self.unix = f"unix:{socket_dir}/agent.sock"

    def token(self, job: str = "", group: str = "g", *, admin: bool = False) -> str:
        assert self.key is not None
        return auth.issue(self.key, admin=True) if admin else auth.issue(self.key, group=group, job=job)

    def stub(self, token: str = "") -> sa_grpc.SnapshotAgentServiceStub:
        return sa_grpc.SnapshotAgentServiceStub(auth.channel(self.tcp, token=token))

    def admin(self) -> sa_grpc.SnapshotAgentServiceStub:
        return self.stub(self.token(admin=True) if self.key else "")


def refused(call: Callable, request: object) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=10)
    return info.value.code(), info.value.details()


def registration_refused(target: str, job: str, token: str, **metadata: str) -> tuple[grpc.StatusCode, str]:
    """Open a WorkloadChannel registering ``job`` as an attacker would (raw stub); the agent's refusal."""
    meta = [*auth.bearer(token)] if token else []
    meta += [(k.replace("_", "-"), v) for k, v in metadata.items()]
    hold = threading.Event()

    def messages() -> Iterator[sa.WorkloadMessage]:
        yield sa.WorkloadMessage(register=sa.RegisterWorkload(job_id=job, group="g"))
        hold.wait(30)

    with grpc.insecure_channel(target) as ch:
        call = sa_grpc.SnapshotAgentServiceStub(ch).WorkloadChannel(messages(), metadata=meta, timeout=10)
        try:
            with pytest.raises(grpc.RpcError) as info:
                next(call)
        finally:
            hold.set()
    return info.value.code(), info.value.details()


def states(stub: sa_grpc.SnapshotAgentServiceStub) -> dict[str, str]:
    st = stub.Status(sa.StatusRequest(), timeout=5)
    return {j.job_id: sa.JobState.Name(j.state) for j in st.job_statuses}


def wait_op(stub: sa_grpc.SnapshotAgentServiceStub, op_id: str, within: float = 30) -> sa.GetOperationResponse:
    deadline = time.monotonic() + within
    while True:
        got = stub.GetOperation(sa.GetOperationRequest(operation_id=op_id), timeout=5)
        if got.status != sa.OPERATION_STATUS_PENDING:
            return got
        assert time.monotonic() < deadline, f"operation {op_id} still pending after {within:g} s"
        time.sleep(0.02)


def cuda(job: str, *pids: int) -> sa.SnapshotRequest:
    return sa.SnapshotRequest(job_id=job, group="g", backend_config=sa.BackendConfig(
        cuda=sa.CudaBackendConfig(explicit_target=sa.ProcessTarget(pids=list(pids)))))


def no_such_pid() -> int:
    with open("/proc/sys/kernel/pid_max", encoding="ascii") as f:
        pid = int(f.read()) - 1
    while os.path.exists(f"/proc/{pid}"):
        pid -= 1
    return pid


class Recorder(http.server.ThreadingHTTPServer):
    """A real HTTP server: ``answer(path) -> (status, headers, body)``; every request line is recorded."""

    def __init__(self, answer: Callable[[str], tuple[int, dict[str, str], bytes]]) -> None:
        self.answer, self.calls = answer, []
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: Recorder

    def log_message(self, *args: object) -> None:
        pass

    def _any(self) -> None:
        self.server.calls.append(f"{self.command} {self.path}")
        n = int(self.headers.get("Content-Length") or 0)
        if n:
            self.rfile.read(n)
        code, headers, body = self.server.answer(self.path)
        self.send_response(code)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _any


def registered(agent: Agent, job: str, *, group: str = "g", token: str | None = None, **kw: object) -> WorkloadClient:
    """A real WorkloadClient (in this process) registering ``job`` with the agent over TCP; it proves this
    process's pid through the agent's door (this process owns the test's HTTP servers)."""
    return WorkloadClient(agent.tcp, job, group, on_snapshot=kw.pop("on_snapshot", lambda *_: None),
                          on_restore=lambda *_: None, token=token or agent.token(job, group),
                          proof=f"{agent.dir}/pid.sock", **kw).wait_registered()  # type: ignore[arg-type]
