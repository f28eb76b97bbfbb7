"""Issue 45 row 12: servers that never answer, spread over several owners, hold nothing another job waits for.

The attacker holds four job tokens (four owners to the agent), registers each job with two servers of its own
that accept and never answer, and snapshots all four at once: eight calls in flight, as many as the old agent had
HTTP threads, so another job's snapshot waited for the step timeout. Now calls are sockets on the agent's loop,
slots are per owner and handed out fairly: the victim's snapshot ends while all eight calls still hang.

The registering process is this test process (it proves its pid through the agent's door), so the listening
sockets it opens here are its own.
"""

from __future__ import annotations

import socket
import threading
import time

from rota.wire import snapshot_agent_pb2 as sa
from tests.security.agentlib import registered

OWNERS, ENDPOINTS = 4, 2


class Silent:
    """A server that accepts every connection, reads nothing and never answers; counts what it accepted."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.accepted: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.accepted:
            c.close()


def test_silent_servers_of_many_owners_do_not_hold_another_jobs_snapshot(start_agent, http_servers):
    agent = start_agent("--op-timeout", "120", "--http-timeout", "60")
    silent = [Silent() for _ in range(OWNERS * ENDPOINTS)]
    fast_server = http_servers(lambda path: (200, {"Content-Type": "application/json"},
                                             b'{"is_sleeping": true}' if "is_sleeping" in path else b"{}"))
    jobs = [f"mallory-{i}" for i in range(OWNERS)]
    clients = [registered(agent, job, app=sa.APP_VLLM, backend="app_endpoint",
                          endpoints=[s.url for s in silent[i * ENDPOINTS:(i + 1) * ENDPOINTS]])
               for i, job in enumerate(jobs)]
    clients.append(registered(agent, "victim", app=sa.APP_VLLM, endpoints=[fast_server.url], backend="app_endpoint"))
    admin = agent.admin()
    try:
        ops = [agent.stub(agent.token(job)).Snapshot(sa.SnapshotRequest(job_id=job, group="g"),
                                                     timeout=10).operation_id for job in jobs]
        deadline = time.monotonic() + 30
        while sum(len(s.accepted) for s in silent) < OWNERS * ENDPOINTS:  # every silent call is in flight now
            assert time.monotonic() < deadline, [len(s.accepted) for s in silent]
            time.sleep(0.01)
        victim = admin.Snapshot(sa.SnapshotRequest(job_id="victim", group="g"), timeout=10).operation_id

        def status(op: str) -> int:
            return admin.GetOperation(sa.GetOperationRequest(operation_id=op), timeout=5).status

        while status(victim) == sa.OPERATION_STATUS_PENDING:  # ends before the hung calls do, or after them
            assert time.monotonic() < deadline + 60, "the victim's snapshot never ended"
            if any(status(op) != sa.OPERATION_STATUS_PENDING for op in ops):
                break
            time.sleep(0.01)
        hung = [status(op) for op in ops]
        assert status(victim) == sa.OPERATION_STATUS_COMPLETE, admin.GetOperation(
            sa.GetOperationRequest(operation_id=victim), timeout=5).error
        assert hung == [sa.OPERATION_STATUS_PENDING] * OWNERS  # was: the victim waited for their timeouts
        assert fast_server.calls == ["POST /sleep?level=1", "GET /is_sleeping"]
    finally:
        for c in clients:
            c.close()
        for s in silent:
            s.close()
