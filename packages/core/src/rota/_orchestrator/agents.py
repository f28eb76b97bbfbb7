"""The orchestrator's links to node agents (rota-agent, ``snapshot_agent.v1alpha1``).

With ``OrchestratorConfig.agents`` (``--agent`` / ``ROTA_AGENTS``), a switch first asks every agent's
``Status`` which of the jobs involved it knows; such a job is parked and restored by its agent
(:class:`AgentLinks`), see :mod:`.driver`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

log = logging.getLogger(__name__)


class AgentLinks:
    """gRPC client of the node agents (``snapshot_agent.v1alpha1.SnapshotAgentService``).

    Channels are opened lazily on the orchestrator's event loop. An agent that does not
    answer ``Status`` within ``STATUS_TIMEOUT_S`` is skipped (logged): its jobs are then
    handled as if no agent knew them.
    """

    STATUS_TIMEOUT_S = 2.0
    # GetOperation polling: every elapsed/POLL_SHARE seconds, within POLL_S. Polling late
    # adds to the switch: a fixed doubling schedule (2 ms .. 50 ms) added ~30% to a
    # 0.1 s switch; this keeps the added wait near 1/POLL_SHARE of the operation.
    POLL_S = (0.001, 0.05)
    POLL_SHARE = 50

    TOKEN_TTL_S = 60.0  # the agent-audience admin token shown to agents; a new one is minted at half its life

    def __init__(self, endpoints: tuple[str, ...], timeout_s: float, *, auth_key: bytes | None = None,
                 tls: Any = None) -> None:
        self.endpoints, self.timeout_s, self.tls = endpoints, timeout_s, tls
        self._stubs: dict[str, object] = {}
        self._channels: list[object] = []
        self._auth_key = auth_key
        self._tokens: dict[str, tuple[float, tuple[tuple[str, str], ...]]] = {}  # endpoint -> (minted, metadata)
        if auth_key is not None and tls is None:
            from rota.auth import plaintext_beyond_loopback

            for e in endpoints:
                if plaintext_beyond_loopback(e):
                    log.warning("WARNING: the link to agent %s is plaintext: whoever can read this network reads "
                                "the admin tokens shown to that agent (each valid 60 s, at that agent only) and "
                                "can park or restore its jobs meanwhile; serve this orchestrator with --tls-cert/"
                                "--tls-key (its agent links then use TLS, ROTA_TLS_CA naming the agents' CA) and "
                                "each agent with --tls-cert/--tls-key", e)

    def _metadata(self, endpoint: str) -> tuple[tuple[str, str], ...]:
        """``authorization`` for the agent at ``endpoint``: an admin token of audience ``rota-agent`` (which
        orchestrators refuse) naming that agent (which every other agent refuses), so one read off an agent
        link acts nowhere else; from the orchestrator's own key (none without one)."""
        if self._auth_key is None:
            return ()
        minted, metadata = self._tokens.get(endpoint, (-1e18, ()))
        if time.monotonic() - minted > self.TOKEN_TTL_S / 2:
            from rota import auth

            metadata = auth.bearer(auth.issue(self._auth_key, admin=True, ttl_s=self.TOKEN_TTL_S,
                                              audience=auth.AGENT_AUDIENCE, agent=endpoint))
            self._tokens[endpoint] = (time.monotonic(), metadata)
        return metadata

    def _stub(self, endpoint: str) -> Any:
        stub = self._stubs.get(endpoint)
        if stub is None:
            import grpc

            from rota._generated import snapshot_agent_pb2_grpc

            ch = grpc.aio.secure_channel(endpoint, self.tls) if self.tls is not None and \
                not endpoint.startswith("unix:") else grpc.aio.insecure_channel(endpoint)
            self._channels.append(ch)
            stub = self._stubs[endpoint] = snapshot_agent_pb2_grpc.SnapshotAgentServiceStub(ch)
        return stub

    async def _status(self, endpoint: str) -> list[tuple[str, int]]:
        import grpc

        from rota._generated import snapshot_agent_pb2 as spb

        try:
            st = await self._stub(endpoint).Status(spb.StatusRequest(), timeout=self.STATUS_TIMEOUT_S,
                                                   metadata=self._metadata(endpoint))
        except grpc.RpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                log.error("agent %s refused this orchestrator's credential (%s: %s): the jobs it holds are NOT "
                          "parked by it; start it with the orchestrator's --auth-key", endpoint, exc.code().name,
                          exc.details())
            else:
                log.warning("agent %s did not answer Status (%s); ignoring it for now", endpoint, exc.code())
            return []
        return [(j.job_id, j.state) for j in st.job_statuses]

    async def locate(self, jobs: set[str]) -> dict[str, str]:
        """job -> agent endpoint, for the ``jobs`` some agent has registered."""
        found: dict[str, str] = {}
        answers = await asyncio.gather(*(self._status(e) for e in self.endpoints))
        for endpoint, states in zip(self.endpoints, answers, strict=True):
            for job, _ in states:
                if job in jobs:
                    found.setdefault(job, endpoint)
        return found

    async def job_states(self) -> list[tuple[str, str, str]]:
        from rota._generated import snapshot_agent_pb2 as spb

        answers = await asyncio.gather(*(self._status(e) for e in self.endpoints))
        out = []
        for endpoint, states in zip(self.endpoints, answers, strict=True):
            for job, state in states:
                out.append((endpoint, spb.JobState.Name(state).removeprefix("JOB_STATE_"), job))
        return out

    async def run(self, endpoint: str, kind: str, job_id: str, group_id: str) -> tuple[bool, str, int, float]:
        """Snapshot or Restore ``job_id`` through ``endpoint``; wait for the operation to end."""
        import grpc

        from rota._generated import snapshot_agent_pb2 as spb

        stub = self._stub(endpoint)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        try:
            if kind == "snapshot":
                op_id = (await stub.Snapshot(spb.SnapshotRequest(job_id=job_id, group=group_id),
                                             timeout=self.timeout_s, metadata=self._metadata(endpoint))).operation_id
            else:
                op_id = (await stub.Restore(spb.RestoreRequest(job_id=job_id, group=group_id),
                                            timeout=self.timeout_s, metadata=self._metadata(endpoint))).operation_id
            while True:
                op = await stub.GetOperation(spb.GetOperationRequest(operation_id=op_id),
                                             timeout=max(0.1, deadline - time.monotonic()),
                                             metadata=self._metadata(endpoint))
                if op.status == spb.OPERATION_STATUS_COMPLETE:
                    return True, "", op.storage_bytes, time.monotonic() - t0
                if op.status == spb.OPERATION_STATUS_FAILED:
                    return False, f"agent {endpoint}: {op.error or 'operation failed'}", 0, time.monotonic() - t0
                if time.monotonic() > deadline:
                    return False, (f"agent {endpoint}: {kind} of job {job_id!r} still pending after "
                                   f"{self.timeout_s:g} s (--park-timeout)"), 0, time.monotonic() - t0
                elapsed = time.monotonic() - t0
                await asyncio.sleep(min(max(elapsed / self.POLL_SHARE, self.POLL_S[0]), self.POLL_S[1]))
        except grpc.RpcError as exc:
            return False, f"agent {endpoint}: {kind} of job {job_id!r}: {exc.code().name}: {exc.details()}", 0, 0.0

    async def close(self) -> None:
        for ch in self._channels:
            await ch.close()  # type: ignore[attr-defined]


__all__ = ["AgentLinks"]
