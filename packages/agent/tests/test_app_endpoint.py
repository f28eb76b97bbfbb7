"""The app_endpoint backend against a real HTTP server speaking vLLM's and SGLang's sleep APIs.

The job registers its server's URL over its WorkloadChannel (a real WorkloadClient in
this process); Snapshot and Restore then name it, or nothing, and the agent calls it.
"""

from __future__ import annotations

import http.server
import json
import os
import threading
import time

import grpc
import pytest

from rota.wire import snapshot_agent_pb2 as sa
from rota_agent import WorkloadClient


class FakeServer(http.server.ThreadingHTTPServer):
    sleeping = False
    fail = False
    calls: list[str]


class Handler(http.server.BaseHTTPRequestHandler):
    server: FakeServer

    def log_message(self, *args: object) -> None:
        pass

    def _reply(self, code: int, body: object) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length).decode() if length else ""
        self.server.calls.append(f"POST {self.path} {body}".strip())
        if self.server.fail:
            return self._reply(500, {"error": "CUDA out of memory"})
        path = self.path.split("?")[0]
        if path in ("/sleep", "/release_memory_occupation"):
            self.server.sleeping = True
        elif path in ("/wake_up", "/resume_memory_occupation"):
            self.server.sleeping = False
        else:
            return self._reply(404, {"error": "no such route"})
        return self._reply(200, {})

    def do_GET(self) -> None:
        self.server.calls.append(f"GET {self.path}")
        self._reply(200, {"is_sleeping": self.server.sleeping})


@pytest.fixture
def server():
    srv = FakeServer(("127.0.0.1", 0), Handler)
    srv.calls = []
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


@pytest.fixture
def registered(agent, socket_dir):
    """registered(job, app, url): a WorkloadClient that declared ``url`` as job's server; closed afterwards.

    It proves its pid through the agent's door: this process owns the server's listening socket."""
    clients = []

    def make(job: str, app: int, url: str, **kw) -> WorkloadClient:
        c = WorkloadClient(agent[0], job, "g", on_snapshot=lambda *_: None, on_restore=lambda *_: None, app=app,
                           endpoints=[url], modes=(sa.SUSPEND_MODE_OFFLOAD, sa.SUSPEND_MODE_DISCARD),
                           proof=os.path.join(socket_dir, "pid.sock"), **kw)
        clients.append(c)
        return c.wait_registered()

    yield make
    for c in clients:
        c.close()


def _run(stub, req, restore=False) -> sa.GetOperationResponse:
    op = (stub.Restore if restore else stub.Snapshot)(req, timeout=5).operation_id
    for _ in range(500):
        got = stub.GetOperation(sa.GetOperationRequest(operation_id=op), timeout=5)
        if got.status != sa.OPERATION_STATUS_PENDING:
            return got
        time.sleep(0.01)
    raise AssertionError("operation never finished")


@pytest.mark.parametrize(("app", "sleep_call", "wake_call"), [
    (sa.APP_VLLM, "POST /sleep?level=2", "POST /wake_up"),
    (sa.APP_SGLANG, 'POST /release_memory_occupation {}', 'POST /resume_memory_occupation {}'),
])
def test_sleep_and_wake(agent_stub, server, registered, app, sleep_call, wake_call):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    registered("llm", app, url + "/")
    cfg = sa.BackendConfig(app_endpoint=sa.AppEndpointConfig(app=app, endpoints=[url], mode=sa.SUSPEND_MODE_DISCARD))
    got = _run(agent_stub, sa.SnapshotRequest(job_id="llm", group="g", backend_config=cfg))
    assert got.status == sa.OPERATION_STATUS_COMPLETE and server.sleeping
    assert server.calls[0] == sleep_call
    got = _run(agent_stub, sa.RestoreRequest(job_id="llm", group="g"), restore=True)
    assert got.status == sa.OPERATION_STATUS_COMPLETE and not server.sleeping
    assert wake_call in server.calls


def test_registered_backend_needs_no_config(agent_stub, server, registered):
    url = f"http://127.0.0.1:{server.server_address[1]}"
    registered("served", sa.APP_VLLM, url, backend="app_endpoint", default_mode=sa.SUSPEND_MODE_OFFLOAD)
    got = _run(agent_stub, sa.SnapshotRequest(job_id="served", group="g"))
    assert got.status == sa.OPERATION_STATUS_COMPLETE and server.calls[0] == "POST /sleep?level=1"
    assert _run(agent_stub, sa.RestoreRequest(job_id="served", group="g"), restore=True).status == \
        sa.OPERATION_STATUS_COMPLETE and not server.sleeping


def test_server_error_faults_the_job_with_its_status_only(agent_stub, server, registered):
    server.fail = True
    url = f"http://127.0.0.1:{server.server_address[1]}"
    registered("oom", sa.APP_VLLM, url)
    cfg = sa.BackendConfig(app_endpoint=sa.AppEndpointConfig(app=sa.APP_VLLM, endpoints=[url]))
    got = _run(agent_stub, sa.SnapshotRequest(job_id="oom", group="g", backend_config=cfg))
    assert got.status == sa.OPERATION_STATUS_FAILED and "HTTP 500" in got.error and url in got.error
    assert "out of memory" not in got.error  # the server's body stays with the agent
    jobs = {j.job_id: j.state for j in agent_stub.Status(sa.StatusRequest(), timeout=5).job_statuses}
    assert jobs["oom"] == sa.JOB_STATE_FAULTED
    with pytest.raises(grpc.RpcError) as info:
        agent_stub.Restore(sa.RestoreRequest(job_id="oom", group="g"), timeout=5)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
