"""gRPC front of an :class:`~rota._engine.Orchestrator`: v1alpha1 and rota.v1 servicers.

The servicers only translate messages and map :class:`rota.errors.RotaError` to the
status codes of shared/WIRE.md; every rule lives in the engine. Used by the
embedded orchestrator (``rota orchestrator serve``) and by ``rota_etcd``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2_grpc

from rota._engine import Orchestrator
from rota._generated import rota_v1_pb2 as pb
from rota._generated import rota_v1_pb2_grpc as pb_grpc
from rota._generated import timeslice_orchestrator_pb2 as v1a
from rota._generated import timeslice_orchestrator_pb2_grpc as v1a_grpc
from rota._grpc_server import bind, health_servicer, rpc_errors
from rota._state import GroupState
from rota._types import TurnRequest
from rota._units import percentile
from rota.errors import InvalidArgument, RotaError

log = logging.getLogger(__name__)


class TimeSliceService(v1a_grpc.TimeSliceOrchestratorServiceServicer):
    """timeslice_orchestrator.v1alpha1, exactly as existing clients expect it."""

    def __init__(self, engine: Orchestrator) -> None:
        self.engine = engine

    @rpc_errors
    async def Acquire(self, request: v1a.AcquireRequest, context: Any) -> v1a.AcquireResponse:
        grant = await self.engine.acquire(TurnRequest(request.job_id, request.group_id))
        return v1a.AcquireResponse(success=True, waited_ms=grant.waited_ms,
                                   context_restored=grant.context_restored)

    @rpc_errors
    async def Yield(self, request: v1a.YieldRequest, context: Any) -> v1a.YieldResponse:
        info = await self.engine.release(request.job_id, request.group_id)
        return v1a.YieldResponse(success=True, pending_waiters=info.pending_waiters,
                                 snapshot_deferred=info.snapshot_deferred)

    @rpc_errors
    async def ListGroups(self, request: v1a.ListGroupsRequest, context: Any) -> v1a.ListGroupsResponse:
        return v1a.ListGroupsResponse(group_ids=[g.group_id for g in await self.engine.status()])

    @rpc_errors
    async def GetGroupStatus(self, request: v1a.GetGroupStatusRequest, context: Any) -> v1a.GetGroupStatusResponse:
        if not request.group_id:
            raise InvalidArgument("group_id is empty; name the group to describe")
        (g,) = await self.engine.status(request.group_id)
        ts = Timestamp()
        ts.GetCurrentTime()
        active = g.holder or (g.residents[-1] if g.residents else "")
        status = v1a.GroupStatus(
            group_id=g.group_id, group_state=v1a.GroupStatus.State.Value("STATE_" + g.status_name()),
            state_timestamp=ts, locking_job=g.holder, active_job=active,
            waiter_queue_depth=len(g.queue), loaded_job=g.loaded_job)
        agent_states = [v1a.SnapshotAgentJobState(agent=agent, job_state=v1a.SnapshotAgentJobState.State.Value(
            "STATE_" + state), job_id=job) for agent, state, job in await _agent_states(self.engine, g.group_id)]
        return v1a.GetGroupStatusResponse(group=status, agent_job_states=agent_states)


async def _agent_states(engine: Any, group_id: str) -> list[tuple[str, str, str]]:
    """Agent job states from engines that talk to agents (others report none)."""
    fn = getattr(engine, "agent_job_states", None)
    return await fn(group_id) if fn is not None else []


class RotaService(pb_grpc.RotaServiceServicer):
    """rota.v1: fencing tokens, sessions, multi-rank jobs, eviction, status."""

    def __init__(self, engine: Orchestrator) -> None:
        self.engine = engine

    @rpc_errors
    async def Acquire(self, request: pb.TurnRequest, context: Any) -> pb.Grant:
        req = TurnRequest(request.job_id, request.group_id, request.priority, request.weight or 1.0,
                          request.world_size or 1, request.rank, request.footprint_bytes)
        g = await self.engine.acquire(req)
        return pb.Grant(token=g.token, waited_ms=g.waited_ms, context_restored=g.context_restored,
                        ttl_ms=g.ttl_ms, max_turn_ms=g.max_turn_ms)

    @rpc_errors
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        info = await self.engine.release(request.job_id, request.group_id, request.token, request.rank,
                                         footprint_bytes=request.footprint_bytes)
        return pb.ReleaseReply(pending_waiters=info.pending_waiters, snapshot_deferred=info.snapshot_deferred,
                               group_released=info.group_released)

    @rpc_errors
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictReply:
        was_holder, was_queued = await self.engine.evict(request.job_id, request.group_id,
                                                         reason=request.reason or "evicted by request")
        return pb.EvictReply(was_holder=was_holder, was_queued=was_queued)

    @rpc_errors
    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusReply:
        groups = await self.engine.status(request.group_id)
        policy = getattr(self.engine.config.policy, "name", "custom")
        return pb.StatusReply(groups=[group_info(g, policy) for g in groups], orchestrator=self.engine.name)

    async def Attach(self, request_iterator: AsyncIterator[pb.TenantMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TenantCommand]:
        """Session stream: hello first, then heartbeats and command results."""
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("message") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Attach message must be hello")
        h = first.hello
        # Only a client that said it handles "restore" commands is ever sent one (prefetch).
        try:
            session = await self.engine.attach(h.job_id, h.group_id, h.rank, h.pid, h.footprint_bytes,
                                               can_prefetch=h.can_prefetch, world_size=h.world_size or 1)
        except RotaError as exc:
            await context.abort(exc.code, str(exc), trailing_metadata=exc.trailers())
        yield pb.TenantCommand(command_id="attached")  # no command: "you are attached", before any grant
        reader = asyncio.create_task(self._read(session, request_iterator))
        why, clean = "stream closed", False  # clean: the tenant said goodbye (Gpu.close) before ending it
        getter: asyncio.Task | None = None
        try:
            while True:
                getter = asyncio.create_task(session.outbox.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    clean = session.said_goodbye
                    why = "tenant closed its session" if clean else "stream ended without a goodbye"
                    break
                kind, cid, token = getter.result()  # token: the reason text for "abort"
                if kind == "close":
                    why = "heartbeat TTL expired"
                    break
                if kind == "abort":  # another rank of the job is gone or faulted
                    yield pb.TenantCommand(command_id=cid, abort=pb.AbortJob(reason=str(token)))
                elif kind == "park":
                    yield pb.TenantCommand(command_id=cid, park=pb.ParkCommand(token=token, mode="offload"))
                elif kind == "restore":  # prefetch: restore ahead of the grant, acknowledged by a result
                    yield pb.TenantCommand(command_id=cid, restore=pb.RestoreCommand(token=token))
                elif kind == "yield":
                    yield pb.TenantCommand(command_id=cid, yield_soon=pb.YieldSoon(reason="maximum turn length"))
        finally:
            reader.cancel()
            if getter is not None:
                getter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            await self.engine.detach(session, why, clean=clean)

    async def _read(self, session: Any, it: AsyncIterator[pb.TenantMessage]) -> None:
        """Heartbeats and command results of one session. If this fails the session
        ends (and its job is treated as dead), so the cause is logged, never swallowed."""
        try:
            async for msg in it:
                kind = msg.WhichOneof("message")
                if kind == "heartbeat":
                    hb = msg.heartbeat
                    self.engine.heartbeat(session, hb.footprint_bytes,
                                          (hb.host_bytes, hb.spilled_bytes, hb.residue_bytes))
                elif kind == "result":
                    r = msg.result
                    self.engine.heartbeat(session, 0)
                    self.engine.command_result(r.command_id, r.ok, r.error, r.bytes, r.seconds)
                elif kind == "goodbye":
                    session.said_goodbye = True
                elif kind == "fault":
                    self.engine.heartbeat(session, 0)
                    await self.engine.fault_rank(session, bounded_text(msg.fault.reason))
        except (asyncio.CancelledError, grpc.RpcError, grpc.aio.AioRpcError):
            raise
        except Exception:
            log.exception("session of job %s in group %s: bad message handling; ending the session",
                          session.job_id, session.group_id)
            raise


REASON_MAX_CHARS = 1000


def bounded_text(text: str, limit: int = REASON_MAX_CHARS) -> str:
    """A caller's free text made safe to log and to show: one line, at most ``limit`` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit] + f"... ({len(flat) - limit} more characters)"


def group_info(g: GroupState, policy: str = "") -> pb.GroupInfo:
    """rota.v1 GroupInfo for one group state (used by Status and by rota_etcd)."""
    import time

    tenants = []
    for rec in g.tenants.values():
        waits, parks = list(rec.waits_ms), list(rec.parks_ms)
        tenants.append(pb.TenantInfo(
            job_id=rec.job_id, state=rec.state, turns=rec.turns, gpu_seconds=rec.gpu_seconds,
            wait_p50_ms=percentile(waits, 50), wait_p99_ms=percentile(waits, 99), park_p50_ms=percentile(parks, 50),
            park_p99_ms=percentile(parks, 99), parked_bytes=rec.parked_bytes, footprint_bytes=rec.footprint_bytes,
            priority=rec.priority, weight=rec.weight, host_bytes=rec.host_bytes, spilled_bytes=rec.spilled_bytes,
            residue_bytes=rec.residue_bytes, fault=rec.fault))
    return pb.GroupInfo(group_id=g.group_id, state=g.status_name(), holder=g.holder, token=g.token,
                        queue=[w.job_id for w in g.queue], loaded_job=g.loaded_job, resident_jobs=g.residents,
                        switches=g.switches, busy_seconds=g.busy_seconds,
                        age_seconds=max(0.0, time.monotonic() - g.created) if g.created else 0.0,
                        tenants=tenants, policy=policy, prefetch_hits=g.prefetch_hits,
                        prefetch_misses=g.prefetch_misses, prefetch_failures=g.prefetch_failures,
                        prefetch_wasted=g.prefetch_wasted)


SERVICE_NAMES = (
    v1a.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"].full_name,
    pb.DESCRIPTOR.services_by_name["RotaService"].full_name,
)


async def serve(engine: Orchestrator, listen: str, *, extra: Callable[[grpc.aio.Server], None] | None = None
                ) -> grpc.aio.Server:
    """Start a gRPC server for ``engine`` on ``listen`` (``host:port`` or ``unix:PATH``)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    v1a_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(TimeSliceService(engine), server)
    pb_grpc.add_RotaServiceServicer_to_server(RotaService(engine), server)
    health = await health_servicer(SERVICE_NAMES)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    engine.health = health  # type: ignore[attr-defined]  # HA stores flip it to NOT_SERVING on followers
    if extra is not None:
        extra(server)
    bind(server, listen)
    await engine.start()
    await server.start()
    return server
