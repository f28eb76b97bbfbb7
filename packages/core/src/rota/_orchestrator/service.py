"""gRPC front of an orchestrator (:class:`rota.orchestrator.OrchestratorProtocol`): v1alpha1 and rota.v1 servicers.

The servicers only translate messages and map :class:`rota.errors.RotaError` to the
status codes of the v1alpha1 API (``timeslice_orchestrator.proto``); every rule lives in the orchestrator. Used by the
embedded orchestrator (``rota orchestrator serve``) and by ``rota_etcd``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from grpc_health.v1 import health_pb2_grpc

from rota._generated import rota_v1_pb2 as pb
from rota._generated import rota_v1_pb2_grpc as pb_grpc
from rota._generated import timeslice_orchestrator_pb2 as v1a
from rota._generated import timeslice_orchestrator_pb2_grpc as v1a_grpc
from rota._ids import check_id, check_pair
from rota._orchestrator.config import check_bytes
from rota._orchestrator.grpc_server import BadMessage, LenientRequests, bind, health_servicer, log_refusal, rpc_errors
from rota._orchestrator.state import GroupState
from rota._tenant.local import private_socket_folder
from rota._types import TurnRequest
from rota._units import percentile
from rota.auth import LOCAL_ADMIN, PermissionDenied, Principal, ServerAuth
from rota.config import MAX_PRIORITY
from rota.devices import MAX_DEVICES, lane_base
from rota.errors import DeadlineExceeded, InvalidArgument, RotaError

if TYPE_CHECKING:
    from rota.orchestrator import OrchestratorProtocol

log = logging.getLogger(__name__)


class _Guarded:
    """Who is calling: every servicer method asks :meth:`caller` before it acts (see :mod:`rota.auth`)."""

    def __init__(self, orchestrator: OrchestratorProtocol, auth: ServerAuth) -> None:
        self.orchestrator, self.auth = orchestrator, auth

    def caller(self, context: Any) -> Principal:
        return self.auth.principal(context.invocation_metadata())

    def acting_for(self, context: Any, group_id: str, job_id: str, action: str) -> Principal:
        """The caller, once the ids are valid and it may ``action`` ``job_id`` of ``group_id``."""
        check_pair(job_id, group_id)
        who = self.caller(context)
        who.require(group_id, job_id, action)
        return who

    async def delivered(self, context: Any, req: TurnRequest) -> Any:
        """The grant, waited for no longer than the caller waits; a grant its caller never receives (the
        deadline passed as it was made) is handed on to the next waiter instead of being held by nobody."""
        remaining = context.time_remaining()
        waiting = self.orchestrator.acquire(req)
        if remaining is not None:
            try:
                grant = await asyncio.wait_for(waiting, max(0.0, remaining - DEADLINE_MARGIN_S))
            except asyncio.TimeoutError:
                raise DeadlineExceeded(f"job {req.job_id!r} was not granted group {req.group_id!r} within the "
                                       "call's deadline; it left the queue, acquire again") from None
        else:
            grant = await waiting
        context.add_done_callback(lambda ctx: ctx.cancelled() and asyncio.ensure_future(
            self.orchestrator.abandon(req.job_id, req.group_id, grant.token)))
        return grant

    async def visible_groups(self, who: Principal, group_id: str) -> list[GroupState]:
        """The groups ``who`` may read: one named group, or all of them (an admin) or its own (a tenant)."""
        if group_id:
            check_id("group_id", group_id, group_id=group_id)
            if not who.may_see(group_id):
                raise PermissionDenied(f"{who.subject} may not read group {group_id!r}; use an admin token or one "
                                       "issued for a job of that group")
            return await self.orchestrator.status(group_id)
        if who.admin:
            return await self.orchestrator.status()
        return [g for g in await self.orchestrator.status() if lane_base(g.group_id) == who.group]  # with its lanes


class TimeSliceService(_Guarded, v1a_grpc.TimeSliceOrchestratorServiceServicer):
    """timeslice_orchestrator.v1alpha1, exactly as existing clients expect it (with a credential where the
    server checks them: the peer's own clients send none, so they work against --insecure or the Unix socket)."""

    @rpc_errors
    async def Acquire(self, request: v1a.AcquireRequest, context: Any) -> v1a.AcquireResponse:
        self.acting_for(context, request.group_id, request.job_id, "acquire for")
        grant = await self.delivered(context, TurnRequest(request.job_id, request.group_id))
        return v1a.AcquireResponse(success=True, waited_ms=grant.waited_ms,
                                   context_restored=grant.context_restored)

    @rpc_errors
    async def Yield(self, request: v1a.YieldRequest, context: Any) -> v1a.YieldResponse:
        self.acting_for(context, request.group_id, request.job_id, "yield for")
        info = await self.orchestrator.release(request.job_id, request.group_id)
        return v1a.YieldResponse(success=True, pending_waiters=info.pending_waiters,
                                 snapshot_deferred=info.snapshot_deferred)

    @rpc_errors
    async def ListGroups(self, request: v1a.ListGroupsRequest, context: Any) -> v1a.ListGroupsResponse:
        groups = await self.visible_groups(self.caller(context), "")
        return v1a.ListGroupsResponse(group_ids=[g.group_id for g in groups[:STATUS_MAX_GROUPS]])

    @rpc_errors
    async def GetGroupStatus(self, request: v1a.GetGroupStatusRequest, context: Any) -> v1a.GetGroupStatusResponse:
        if not request.group_id:
            raise InvalidArgument("group_id is empty; name the group to describe")
        who = self.caller(context)
        (g,) = await self.visible_groups(who, request.group_id)
        ts = Timestamp()
        ts.GetCurrentTime()
        active = g.holder or (g.residents[-1] if g.residents else "")
        hide = _hider(who)
        status = v1a.GroupStatus(
            group_id=g.group_id, group_state=v1a.GroupStatus.State.Value("STATE_" + g.status_name()),
            state_timestamp=ts, locking_job=hide(g.holder), active_job=hide(active),
            waiter_queue_depth=len(g.queue), loaded_job=hide(g.loaded_job))
        states = await self.orchestrator.agent_job_states(g.group_id) if who.admin else []
        agent_states = [v1a.SnapshotAgentJobState(agent=agent, job_state=v1a.SnapshotAgentJobState.State.Value(
            "STATE_" + state), job_id=job) for agent, state, job in states]
        return v1a.GetGroupStatusResponse(group=status, agent_job_states=agent_states)


def _hider(who: Principal) -> Any:
    """Names of other jobs are not shown to a tenant (another team's job ids are theirs)."""
    def hide(job: str) -> str:
        return job if who.admin or not job or who.may_act_for(who.group, job) else OTHER_JOB

    return hide


def _turn_request(request: pb.TurnRequest) -> TurnRequest:
    """A TurnRequest from the wire (the orchestrator bounds every number of it)."""
    if len(request.devices) > MAX_DEVICES:  # bounded before anything reads them
        raise InvalidArgument(f"{len(request.devices)} devices named; at most {MAX_DEVICES}")
    return TurnRequest(request.job_id, request.group_id, request.priority, request.weight or 1.0,
                       request.world_size or 1, request.rank, request.footprint_bytes, tuple(request.devices),
                       request.quiet)


class RotaService(_Guarded, pb_grpc.RotaServiceServicer):
    """rota.v1: fencing tokens, sessions, multi-rank jobs, eviction, status; every call authorized."""

    @rpc_errors
    async def Acquire(self, request: pb.TurnRequest, context: Any) -> pb.Grant:
        who = self.acting_for(context, request.group_id, request.job_id, "acquire for")
        if request.priority <= MAX_PRIORITY:  # beyond it the orchestrator says INVALID_ARGUMENT, naming the range
            who.check_priority(request.priority)
        g = await self.delivered(context, _turn_request(request))
        return pb.Grant(token=g.token, waited_ms=g.waited_ms, context_restored=g.context_restored,
                        ttl_ms=g.ttl_ms, max_turn_ms=g.max_turn_ms, device=g.device)

    @rpc_errors
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseReply:
        self.acting_for(context, request.group_id, request.job_id, "release for")
        if request.token <= 0:
            raise InvalidArgument("token is missing: a rota.v1 Release must carry the token of its grant")
        restore_s = request.restore_seconds
        if not 0 <= restore_s <= MAX_RESTORE_SECONDS:  # NaN fails this too
            raise InvalidArgument(f"restore_seconds {restore_s!r} must be a number of seconds from 0 to "
                                  f"{MAX_RESTORE_SECONDS:g}")
        info = await self.orchestrator.release(request.job_id, request.group_id, request.token, request.rank,
                                         footprint_bytes=check_bytes("footprint_bytes", request.footprint_bytes),
                                         restore_seconds=restore_s)
        return pb.ReleaseReply(pending_waiters=info.pending_waiters, snapshot_deferred=info.snapshot_deferred,
                               group_released=info.group_released)

    @rpc_errors
    async def Evict(self, request: pb.EvictRequest, context: Any) -> pb.EvictReply:
        who = self.acting_for(context, request.group_id, request.job_id, "evict")
        if len(request.reason) > REASON_MAX_CHARS:
            raise InvalidArgument(f"reason is {len(request.reason)} characters long; give at most {REASON_MAX_CHARS}")
        reason = bounded_text(request.reason) or "evicted by request"
        was_holder, was_queued = await self.orchestrator.evict(request.job_id, request.group_id,
                                                         reason=f"{reason} (by {who.subject})")
        return pb.EvictReply(was_holder=was_holder, was_queued=was_queued)

    @rpc_errors
    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusReply:
        who = self.caller(context)
        if request.page_size < 0:
            raise InvalidArgument(f"page_size {request.page_size} is negative; use 0 for the server's default")
        groups = [g for g in await self.visible_groups(who, request.group_id) if g.group_id > request.page_token]
        size = min(request.page_size or STATUS_MAX_GROUPS, STATUS_MAX_GROUPS)
        page, more = groups[:size], len(groups) > size
        policy = getattr(self.orchestrator.config.policy, "name", "custom")
        return pb.StatusReply(groups=[group_info(g, policy, viewer=who) for g in page],
                              orchestrator=self.orchestrator.name, next_page_token=page[-1].group_id if more else "")

    async def Attach(self, request_iterator: AsyncIterator[pb.TenantMessage],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.TenantCommand]:
        """Session stream: hello first, then heartbeats and command results."""
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        if isinstance(first, BadMessage) or first.WhichOneof("message") != "hello":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first Attach message must be hello")
        h = first.hello
        # Only a client that said it handles "restore" commands is ever sent one (prefetch).
        try:
            self.acting_for(context, h.group_id, h.job_id, "attach as")
            session = await self.orchestrator.attach(h.job_id, h.group_id, h.rank, h.pid,
                                               check_bytes("footprint_bytes", h.footprint_bytes),
                                               can_prefetch=h.can_prefetch, world_size=h.world_size or 1,
                                               resume=h.resume)
        except RotaError as exc:
            log_refusal("Attach", context, exc)
            await context.abort(exc.code, str(exc), trailing_metadata=exc.trailers())
        # no command: "you are attached", before any grant; with the secret that lets this process reconnect
        # memory_once: we record a result's memory and keep it through heartbeats that say it did not change
        yield pb.TenantCommand(command_id="attached", resume=session.resume, memory_once=True)
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
            await self.orchestrator.detach(session, why, clean=clean)

    async def _read(self, session: Any, it: AsyncIterator[pb.TenantMessage]) -> None:
        """Heartbeats and command results of one session. If this fails the session
        ends (and its job is treated as dead), so the cause is logged, never swallowed."""
        try:
            async for msg in it:
                if isinstance(msg, BadMessage):
                    raise msg.error()
                kind = msg.WhichOneof("message")
                if kind == "heartbeat":
                    hb = msg.heartbeat
                    check_bytes("footprint_bytes", hb.footprint_bytes)
                    self.orchestrator.heartbeat(session, hb.footprint_bytes,
                                                None if hb.memory_unchanged else memory_of(hb))
                elif kind == "result":  # a park's or restore's memory comes with it (not again in a heartbeat),
                    # recorded before the result is: the switch that waits for it sees what the park left
                    r = msg.result
                    self.orchestrator.heartbeat(session, 0, memory_of(r.memory) if r.HasField("memory") else None)
                    self.orchestrator.command_result(r.command_id, r.ok, r.error, r.bytes, r.seconds)
                elif kind == "goodbye":
                    session.said_goodbye = True
                elif kind == "fault":
                    self.orchestrator.heartbeat(session, 0)
                    await self.orchestrator.fault_rank(session, bounded_text(msg.fault.reason))
        except (asyncio.CancelledError, grpc.RpcError, grpc.aio.AioRpcError):
            raise
        except RotaError as exc:  # a bad message from this tenant: its session ends, the cause logged
            log.warning("session of job %s in group %s: %s; ending the session", session.job_id, session.group_id,
                        exc)
            raise
        except Exception:
            log.exception("session of job %s in group %s: bad message handling; ending the session",
                          session.job_id, session.group_id)
            raise


REASON_MAX_CHARS = 1000
DEADLINE_MARGIN_S = 0.05  # an Acquire gives up this long before its caller's deadline, so its answer arrives
OTHER_JOB = "(another job)"  # what a tenant sees of the other jobs of its group
STATUS_MAX_GROUPS = 500  # groups per Status reply; more come in pages
MAX_REQUEST = 8 << 20  # bytes of one request message (larger: RESOURCE_EXHAUSTED before it is read)


def memory_of(msg: pb.Heartbeat | pb.Memory) -> tuple[int, int, int]:
    """(host, spilled, residue) bytes a tenant reported, each checked."""
    host, spilled, residue = (check_bytes(name, getattr(msg, name)) for name in ("host_bytes", "spilled_bytes",
                                                                              "residue_bytes"))
    return host, spilled, residue


def bounded_text(text: str, limit: int = REASON_MAX_CHARS) -> str:
    """A caller's free text made safe to log and to show: one line, control characters escaped, at most
    ``limit`` characters (a forged log line cannot be written through it)."""
    flat = "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in " ".join(text.split()))
    return flat if len(flat) <= limit else flat[:limit] + f"... ({len(flat) - limit} more characters)"


def group_info(g: GroupState, policy: str = "", *, viewer: Principal = LOCAL_ADMIN) -> pb.GroupInfo:
    """rota.v1 GroupInfo for one group state (used by Status and by rota_etcd).

    A tenant ``viewer`` sees its own record, the other jobs only as their place in the
    queue (not their ids or accounting) and no fencing token.
    """
    import time

    hide = _hider(viewer)
    tenants = []
    for rec in g.tenants.values():
        if hide(rec.job_id) == OTHER_JOB:
            continue
        waits, parks = list(rec.waits_ms), list(rec.parks_ms)
        tenants.append(pb.TenantInfo(
            job_id=rec.job_id, state=rec.state, turns=rec.turns, gpu_seconds=rec.gpu_seconds,
            wait_p50_ms=percentile(waits, 50), wait_p99_ms=percentile(waits, 99), park_p50_ms=percentile(parks, 50),
            park_p99_ms=percentile(parks, 99), parked_bytes=rec.parked_bytes, footprint_bytes=rec.footprint_bytes,
            priority=rec.priority, weight=rec.weight, host_bytes=rec.host_bytes, spilled_bytes=rec.spilled_bytes,
            residue_bytes=rec.residue_bytes, fault=rec.fault, parks_failed=rec.parks_failed,
            restores_failed=rec.restores_failed))
    return pb.GroupInfo(group_id=g.group_id, state=g.state(), holder=hide(g.holder),
                        token=g.token if viewer.admin else 0,
                        queue=[hide(w.job_id) for w in g.queue], loaded_job=hide(g.loaded_job),
                        resident_jobs=[hide(j) for j in g.residents],
                        switches=g.switches, busy_seconds=g.busy_seconds,
                        age_seconds=max(0.0, time.monotonic() - g.created) if g.created else 0.0,
                        tenants=tenants, policy=policy, prefetch_hits=g.prefetch_hits,
                        prefetch_misses=g.prefetch_misses, prefetch_failures=g.prefetch_failures,
                        prefetch_wasted=g.prefetch_wasted)


MAX_RESTORE_SECONDS = 86400.0  # a Release's restore_seconds: a day at most (it feeds a histogram)

SERVICE_NAMES = (
    v1a.DESCRIPTOR.services_by_name["TimeSliceOrchestratorService"].full_name,
    pb.DESCRIPTOR.services_by_name["RotaService"].full_name,
)
# grpc.health.v1 names: SERVICE_NAMES are SERVING where calls are answered (a follower
# replica answers too: reads itself, the rest redirected to the leader); LEADER_HEALTH is
# SERVING only where turns are granted (a single orchestrator, or the leading replica).
LEADER_HEALTH = "rota.leader"


async def serve(orchestrator: OrchestratorProtocol, listen: str, *,
                extra: Callable[[grpc.aio.Server], None] | None = None, auth: ServerAuth | None = None,
                tls: grpc.ServerCredentials | None = None) -> grpc.aio.Server:
    """Start a gRPC server for ``orchestrator`` on ``listen`` (``host:port`` or ``unix:PATH``).

    ``auth`` says who may call (:class:`rota.auth.ServerAuth`; default: a Unix socket's
    owner, or, on TCP, nobody without a token); ``tls``: the server's certificate. A Unix
    socket is served only in a 0700 folder of this uid (:func:`rota._tenant.local.private_socket_folder`)
    and made 0600.
    """
    auth = auth or ServerAuth(local=listen.startswith("unix:"))
    server = grpc.aio.server(interceptors=[LenientRequests()],
                             options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", MAX_REQUEST)])
    v1a_grpc.add_TimeSliceOrchestratorServiceServicer_to_server(TimeSliceService(orchestrator, auth), server)
    pb_grpc.add_RotaServiceServicer_to_server(RotaService(orchestrator, auth), server)
    health = await health_servicer((*SERVICE_NAMES, LEADER_HEALTH))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    orchestrator.report_health_to(health)
    if extra is not None:
        extra(server)
    unix = listen.removeprefix("unix:") if listen.startswith("unix:") else ""
    if unix:
        private_socket_folder(unix)
    bind(server, listen, tls)
    await orchestrator.start()
    await server.start()
    if unix:
        os.chmod(unix, 0o600)
    return server
