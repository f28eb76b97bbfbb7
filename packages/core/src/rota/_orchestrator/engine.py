"""The orchestrator engine: drives group state machines over an async store.

:class:`Orchestrator` owns the rules of *when* things happen — blocking acquires,
parking residents before a grant, tenant sessions and their liveness, maximum turn
length — while :mod:`rota._orchestrator.state` owns *what* a transition does and a
:class:`GroupStore` owns where state lives. The embedded orchestrator uses
:class:`MemoryStore`; ``rota_etcd`` supplies a store whose ``commit`` is an etcd
transaction conditioned on its leadership, so a deposed leader cannot grant.

Locks: one asyncio lock per group (``self._lock(group_id)``) guards that group's
state and its commit, so a slow store (etcd) serializes the transitions of one
group, never those of all groups. No code holds two of them at once, and none is
held while waiting on a tenant or an agent: park commands and agent operations are
sent and awaited outside it.

Agents (rota-agent, ``snapshot_agent.v1alpha1``): with ``OrchestratorConfig.agents``
(``--agent`` / ``ROTA_AGENTS``), a switch first asks every agent's ``Status`` which of
the jobs involved it knows. A job registered with an agent is parked by that agent
(``Snapshot``, then ``GetOperation`` until done) instead of through its rota session,
and an incoming job that was parked and is registered with an agent is restored by it
(``Restore``) *at the same time* as the outgoing jobs are parked, before its grant.
A failed or timed-out agent operation FAULTs that job and the group moves on.

Prefetch (``OrchestratorConfig.prefetch``, on by default when ``capacity_bytes`` is
known): while a holder runs, the job the policy would grant next is restored early if
it is parked and fits (all footprints known), through its agent or through its sessions
(when the tenant's client can restore on command). To make room it parks idle residents
first, oldest first as a switch would, so both directions of the switch happen during
the holder's turn; it never parks the holder or a job that is waiting for a turn. At
most one prefetch per group runs at a time, and the group's driver
waits for it before it starts a switch, so a grant never races a prefetch's restore
and never starts a second one. A failed prefetch is handled like a failed restore of
the same kind: by an agent, the job is FAULTED; by the tenant, it stays parked (and its
client restores it at its grant, as without prefetch).

Environment:
    ROTA_AGENTS   comma-separated ``host:port`` of node agents (when ``agents`` is unset)
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import math
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from rota._ids import check_id, check_pair
from rota._orchestrator import lanes as _lanes
from rota._orchestrator.state import GONE, GroupState
from rota._types import Grant, ReleaseInfo, TurnRequest
from rota.config import MAX_PRIORITY, MIN_PRIORITY
from rota.devices import MAX_DEVICES, lane_base, lane_device, parse_devices
from rota.errors import AlreadyAttached, Faulted, InvalidArgument, NotFound, RotaError, Unavailable
from rota.policies import Fifo, Policy

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _whole(fn: Callable[..., Awaitable[_T]]) -> Callable[..., Awaitable[_T]]:
    """Run a transition to its end even if the caller is cancelled part-way.

    A transition changes a group in memory and then awaits ``store.commit``. A gRPC
    handler cancelled at that await (its client went away) would leave memory, the
    store and the waiters disagreeing: a holder removed but nobody granted next.
    Shielded, the transition always finishes; only the caller stops waiting.
    """

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> _T:
        task = asyncio.ensure_future(fn(*args, **kwargs))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if nobody awaits it
        return await asyncio.shield(task)

    return wrapper


def _fail(fut: asyncio.Future, exc: BaseException) -> None:
    """Fail a grant future whose caller may be gone (then nobody would read the error)."""
    fut.set_exception(exc)
    fut.exception()  # marks it retrieved: no "exception was never retrieved" noise


class GroupStore(Protocol):
    """Where group state lives. Implementations: :class:`MemoryStore`, rota_etcd's.

    A store may offer ``delete(group_id)``: groups idle for ``idle_group_ttl_s`` are then
    forgotten there too. (An orchestrator of another kind than this engine, e.g. rota_etcd's
    HA replica, comes from the ``rota_orchestrator`` hook, not from its store.)
    """

    async def load_all(self) -> dict[str, GroupState]:
        """Every stored group (called once when the orchestrator starts)."""

    async def commit(self, state: GroupState) -> None:
        """Persist ``state``; raise :class:`rota.errors.Unavailable` if it cannot be
        made durable (then the transition must not take effect)."""


class MemoryStore:
    """State in this process only: the embedded single-host orchestrator."""

    async def load_all(self) -> dict[str, GroupState]:
        return {}

    async def commit(self, state: GroupState) -> None:
        return None

    async def delete(self, group_id: str) -> None:
        return None


@dataclass
class OrchestratorConfig:
    """Knobs of one orchestrator; every value is validated by :meth:`check`."""

    groups: tuple[str, ...] = ()  # fixed groups; empty = create on first use
    policy: Policy = field(default_factory=Fifo)
    ttl_s: float = 10.0  # a session silent this long is dead
    park_timeout_s: float = 120.0  # a park not acknowledged by then faults the tenant
    v1_max_turn_s: float = 600.0  # turn limit for clients without a session (0 = none): they send no heartbeats
    idle_group_ttl_s: float = 600.0  # a group with nothing in it for this long is forgotten (0 = never)
    ended_tenant_ttl_s: float = 600.0  # a tenant that left (idle, lost, faulted) is forgotten after this (0 = never)
    capacity_bytes: int = 0  # device bytes per group for residency checks (0 = unknown)
    idle_exit_s: float = 0.0  # exit after this long with no tenants (0 = never)
    agents: tuple[str, ...] = field(default_factory=lambda: _agents_from_env())  # node agents (rota-agent)
    agent_auth_key: bytes | None = field(default=None, repr=False)  # mints the admin tokens agents check
    agent_tls: Any = field(default=None, repr=False)  # grpc.ChannelCredentials of the agent links (None: plaintext)
    prefetch: bool | None = None  # restore the next waiter during the current turn (None = on iff capacity known)

    @property
    def prefetch_on(self) -> bool:
        """Whether prefetch runs: as set, or by default whenever the device size is known."""
        return self.capacity_bytes > 0 if self.prefetch is None else bool(self.prefetch)

    def check(self) -> None:
        if self.prefetch is not None and not isinstance(self.prefetch, bool):
            raise InvalidArgument(f"prefetch={self.prefetch!r} must be True, False or None "
                                  "(None = on when capacity_bytes > 0)")
        if self.prefetch and self.capacity_bytes <= 0:
            raise InvalidArgument(f"prefetch=True needs the device size, but capacity_bytes={self.capacity_bytes!r}; "
                                  "set --capacity (e.g. 80GiB) or use --no-prefetch")
        for a in self.agents:
            host, _, port = a.rpartition(":")
            if not (a.startswith("unix:") and len(a) > 5) and not (host and port.isdigit() and 0 < int(port) < 65536):
                raise InvalidArgument(f"agent address {a!r} is not host:port or unix:PATH (e.g. 10.0.0.5:9001); "
                                      "fix --agent / ROTA_AGENTS")
        for name in ("ttl_s", "park_timeout_s"):
            if getattr(self, name) <= 0:
                raise InvalidArgument(f"{name}={getattr(self, name)!r} must be > 0 seconds")
        for name in ("v1_max_turn_s", "idle_exit_s", "capacity_bytes", "idle_group_ttl_s", "ended_tenant_ttl_s"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"{name}={getattr(self, name)!r} must be >= 0 (0 disables it)")
        for g in self.groups:
            check_id("group_id", g, group_id=g)


@dataclass(eq=False)
class Session:
    """A tenant process attached through ``rota.v1.RotaService/Attach``."""

    job_id: str
    group_id: str
    rank: int
    pid: int
    outbox: asyncio.Queue
    last_seen: float
    alive: bool = True
    pending: set[str] = field(default_factory=set)  # park commands not yet acknowledged
    memory: tuple[int, int, int] = (0, 0, 0)  # host, spilled, residue bytes from the last heartbeat
    can_prefetch: bool = False  # its client restores parked state on a "restore" command (ahead of its grant)
    world_size: int = 1  # ranks of its job: losing one of several ends the whole job's turn
    said_goodbye: bool = False  # the tenant closed the session on purpose (a dead process cannot)
    resume: str = field(default_factory=lambda: secrets.token_hex(16))  # shown again to take this session over


class Orchestrator:
    """Grants groups to jobs, one holder at a time, parking residents as needed."""

    def __init__(self, config: OrchestratorConfig | None = None, store: GroupStore | None = None,
                 *, name: str = "embedded") -> None:
        self.config = config or OrchestratorConfig()
        self.config.check()
        self.store: GroupStore = store or MemoryStore()
        self.name = name
        self.groups: dict[str, GroupState] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._grants: dict[tuple[str, str], asyncio.Future] = {}
        self._sessions: dict[tuple[str, str], list[Session]] = {}
        self._attached_once: set[tuple[str, str]] = set()  # jobs that speak rota.v1
        # jobs of a previous life not re-attached yet -> when they last called (acquire, release): a job that
        # calls is alive, so its TTL to re-attach its session counts from its last call, not from our start
        self._called: dict[tuple[str, str], float] = {}
        self._pending: dict[str, asyncio.Future] = {}
        self._drivers: dict[str, asyncio.Task] = {}
        self._yield_sent: set[tuple[str, int]] = set()
        self._turn_restores: dict[tuple[str, int], float] = {}  # (group, token) -> slowest rank's restore so far
        self._prefetching: dict[str, tuple[str, asyncio.Task]] = {}  # group -> (job, its prefetch)
        self._prefetch_failed: set[tuple[str, str, int]] = set()  # (group, job, token): not retried this turn
        self._tasks: list[asyncio.Task] = []
        self._idle_since = time.monotonic()
        self.stopped = asyncio.Event()
        self.metrics: Any = None  # an OrchestratorMetrics when /metrics is served (report_metrics_to)
        self.agents = AgentLinks(self.config.agents, self.config.park_timeout_s, auth_key=self.config.agent_auth_key,
                                 tls=self.config.agent_tls) if self.config.agents else None

    # ------------------------------------------------------------- lifecycle

    @property
    def leading(self) -> bool:
        """Always True: this engine grants the turns of every group it has."""
        return True

    def report_health_to(self, health: Any) -> None:
        """Nothing to report: this engine always answers and leads, so every health name stays SERVING."""

    def report_metrics_to(self, metrics: Any) -> None:
        """Count grants, parks and collected tenants in ``metrics`` (an ``OrchestratorMetrics``)."""
        self.metrics = metrics

    async def start(self) -> None:
        self.groups = await self.store.load_all()
        now = time.monotonic()
        for g in self.groups.values():  # jobs from a previous life get one TTL to re-attach
            for job in {g.holder, *[w.job_id for w in g.queue], *g.residents} - {""}:
                if not g.tenant(job).attached:  # v1alpha1-only: no session to wait for
                    continue
                self._attached_once.add((g.group_id, job))
                self._sessions.setdefault((g.group_id, job), [])
            self._kick(g.group_id)
        for group_id in self.config.groups:
            await self._group(group_id, create=True)
        self._started = now
        self._tasks.append(asyncio.create_task(self._watchdog()))

    def close_sessions(self) -> None:
        """Close every tenant's session stream, so tenants re-attach elsewhere (e.g. to the next leader)."""
        for sessions in list(self._sessions.values()):
            for s in sessions:
                s.outbox.put_nowait(("close", "", 0))

    async def stop(self) -> None:
        self.stopped.set()  # first: an acquire committing meanwhile then fails instead of waiting forever
        for t in self._tasks + list(self._drivers.values()) + [t for _, t in self._prefetching.values()]:
            t.cancel()
        for fut in self._grants.values():
            if not fut.done():
                _fail(fut, Unavailable("orchestrator is shutting down; retry against its successor"))
        if self.agents is not None:
            await self.agents.close()

    # ------------------------------------------------------------------ API

    def job_alive(self, group_id: str, job_id: str) -> bool:
        """Whether ``job_id`` shows life in ``group_id``: a live session seen within the TTL, or (a job of a
        previous life that has not re-attached yet) a call within the TTL; a v1alpha1 job, which has no
        session to judge by, always does."""
        key = (lane_base(group_id), job_id)  # a lane's jobs attach to its group
        if key not in self._attached_once:
            return True
        now = time.monotonic()
        if any(s.alive and now - s.last_seen <= self.config.ttl_s for s in self._sessions.get(key, ())):
            return True
        return now - self._called.get(key, -math.inf) <= self.config.ttl_s

    def _note_call(self, key: tuple[str, str]) -> None:
        if key in self._attached_once and not self._live_sessions(key):
            self._called[key] = time.monotonic()

    async def acquire(self, req: TurnRequest) -> Grant:
        """Block until ``req.job_id`` holds ``req.group_id``."""
        check_pair(req.job_id, req.group_id)
        _check_request(req)
        key = (req.group_id, req.job_id)
        self._note_call(key)
        try:
            grant, fut = await self._enqueue(req)
            if fut is not None:
                grant = await asyncio.shield(fut)
            self._note_call(key)  # granted: the TTL to re-attach counts from the grant, not from the ask
            if grant.group_id != req.group_id:  # granted in a lane: the group, and the device of this turn
                from dataclasses import replace

                grant = replace(grant, group_id=req.group_id, device=lane_device(grant.group_id))
            return self._with_limits(grant)
        except asyncio.CancelledError:
            if not self._live_sessions(key):  # a v1alpha1 caller gave up: leave the queue, or hand back a
                await self._leave_queue(req.job_id, req.group_id)  # grant it can no longer learn of
            raise

    @_whole
    async def _enqueue(self, req: TurnRequest) -> tuple[Grant | None, asyncio.Future | None]:
        """Queue the job (committed) and return its grant future, or its current grant."""
        async with self._lock(req.group_id):
            req = await self._lane_request(req)
            g = await self._group(req.group_id)
            if g.tenants.get(req.job_id) and g.tenants[req.job_id].state == "faulted":
                g.tenants[req.job_id].state = "idle"  # FAULTED is retryable: this acquire retries it
            grant = g.enqueue(req, time.monotonic())
            if grant is not None:
                return grant, None
            key = (req.group_id, req.job_id)
            grant = self._grant_at_once(g, req.job_id)
            try:
                await self.store.commit(g)  # the enqueue, and with an immediate grant the grant too: one commit
            except RotaError as exc:
                if grant is not None:  # not durable: other ranks of the job waiting for it fail too
                    self._settle(key, exc)
                raise
            if self.stopped.is_set():  # stopped while this committed: nothing here would ever grant it
                raise Unavailable(f"orchestrator {self.name} stopped; retry against its successor (job="
                                  f"{req.job_id!r}, group={req.group_id!r})", job_id=req.job_id, group_id=req.group_id)
            if grant is not None:
                if self.metrics is not None:
                    self.metrics.granted(req.group_id, grant.waited_ms / 1000.0)
                self._settle(key, grant)  # other ranks of the job that asked before this one
                self._maybe_prefetch(g)
                return grant, None
            fut = self._grants.get(key)
            if fut is None or fut.done():
                fut = self._grants[key] = asyncio.get_running_loop().create_future()
            self._kick(req.group_id)
        return None, fut

    async def _lane_request(self, req: TurnRequest) -> TurnRequest:
        """``req`` for the lane its turn is placed in, if it names devices (else ``req``), under the lock.

        Tenants of one group either all name devices or none do; a job whose state leaves
        another lane has that lane committed here, and is ``parked`` in its new one (its
        grant then says its state must be brought in).
        """
        lanes = _lanes.lanes_of(self.groups, req.group_id)
        plain = self.groups.get(req.group_id)
        where = f"(job={req.job_id!r}, group={req.group_id!r})"
        if not req.devices:
            if lanes:
                raise InvalidArgument(f"group {req.group_id!r} spans devices ({', '.join(sorted(lanes))}) but this "
                                      f"acquire names none {where}; give every tenant of the group ROTA_DEVICES")
            return req
        if plain is not None and (plain.holder or plain.queue or plain.residents):
            raise InvalidArgument(f"group {req.group_id!r} is used by tenants that name no devices, but this acquire "
                                  f"names {', '.join(req.devices)} {where}; give every tenant of a group the same "
                                  "kind of ROTA_DEVICES (or none)")
        lane, left, choice = _lanes.choose_lane(self.groups, req.group_id, req.job_id, req.devices,
                                                req.footprint_bytes, self.config.capacity_bytes)
        if left:
            await self.store.commit(self.groups[left])
            self._kick(left)
            log.info("job %s in group %s: its state moves from %s to %s (%s)", req.job_id, req.group_id,
                     lane_device(left), lane_device(lane), choice.reason if choice else "")
        g = await self._group(lane, create=self._may_create(req.group_id))
        if left:
            g.tenant(req.job_id).state = "parked"  # not on this device yet: its grant brings it in
        from dataclasses import replace

        return replace(req, group_id=lane)

    def _may_create(self, group_id: str) -> bool:
        return not self.config.groups or lane_base(group_id) in self.config.groups

    def _begin_switch(self, g: GroupState, chosen: Any) -> list[str]:
        """``g.begin_switch``; in a lane, the residents parked are the cheapest set (rota.placement)."""
        choose = _lanes.evict_chooser(self.groups, g, self.config.capacity_bytes) \
            if _lanes.is_lane(g.group_id) else None
        return g.begin_switch(chosen, self.config.capacity_bytes, choose)

    def _turn_lane(self, group_id: str, job_id: str) -> str:
        """The lane of ``group_id`` where ``job_id`` holds or waits (``group_id`` itself when it has none)."""
        lane = _lanes.lane_with(self.groups, group_id, job_id)
        return lane.group_id if lane is not None else group_id

    def _grant_at_once(self, g: GroupState, job_id: str) -> Grant | None:
        """Grant ``job_id`` now, under the group's lock, if nothing has to happen first: the group is free,
        no prefetch runs, the policy picks this job, and no resident has to be parked (no agents to ask).

        Its caller then commits the enqueue and the grant together (one etcd transaction for a tenant alone
        in its group, not two); otherwise (None) the group's driver grants as usual.
        """
        if self.agents is not None or g.group_id in self._prefetching or not g.ready_for_grant():
            return None
        chosen = self.config.policy.choose(g.grantable(), g.tenants, time.monotonic())
        if chosen is None or chosen.job_id != job_id:
            return None
        evict = self._begin_switch(g, chosen)
        if any(self._live_sessions((g.group_id, j)) for j in evict):  # parks first: the driver's job
            g.abort_switch()
            return None
        return g.complete_grant(time.monotonic(), prefetch=self.config.prefetch_on)

    def _settle(self, key: tuple[str, str], outcome: Grant | BaseException) -> None:
        """Answer the pending acquire of ``key`` (a grant, or the error that prevented it), if one waits."""
        fut = self._grants.pop(key, None)
        if fut is None or fut.done():
            return
        if isinstance(outcome, BaseException):
            _fail(fut, outcome)
        else:
            fut.set_result(outcome)

    @_whole
    async def _leave_queue(self, job_id: str, group_id: str) -> None:
        """A caller without a session stopped waiting: it leaves the queue, and a grant made to it in the
        meantime (its deadline passed as the holder released) goes to the next waiter instead of being held by
        nobody."""
        async with self._lock(group_id):  # after a still-running _enqueue of the same call (FIFO)
            group_id = self._turn_lane(group_id, job_id)
            fut = self._grants.pop((group_id, job_id), None)
            if fut is not None and not fut.done():
                fut.cancel()
            g = self.groups.get(group_id)
            if g is None:
                return
            if g.holder == job_id:
                log.warning("job %s was granted group %s after its caller stopped waiting; the turn goes to the "
                            "next waiter", job_id, group_id)
            g.remove(job_id, time.monotonic(), lost=False)
            await self.store.commit(g)
            self._kick(group_id)

    @_whole
    async def abandon(self, job_id: str, group_id: str, token: int) -> None:
        """A grant its caller never received (the call ended as it was made): a job without a session
        cannot learn of it, so the turn goes to the next waiter. Jobs with sessions acquire again and
        get the same grant back."""
        if self._live_sessions((group_id, job_id)):
            return
        async with self._lock(group_id):
            group_id = self._turn_lane(group_id, job_id)
            g = self.groups.get(group_id)
            if g is None or g.holder != job_id or g.token != token:
                return
            log.warning("job %s was granted group %s (token %d) but its call ended first; the turn goes to the "
                        "next waiter", job_id, group_id, token)
            g.remove(job_id, time.monotonic(), lost=False)
            await self.store.commit(g)
            self._kick(group_id)

    @_whole
    async def release(self, job_id: str, group_id: str, token: int = 0, rank: int = 0, *,
                      footprint_bytes: int = 0, restore_seconds: float = 0.0) -> ReleaseInfo:
        """One rank of the holder releases; the group moves on when all ranks have.

        ``footprint_bytes`` (> 0): what the turn needed on the device, recorded before the next switch.
        ``restore_seconds`` (> 0): how long this rank restored its state at the turn's start; the job's
        restore (its slowest rank) is observed once, when its last rank releases.
        """
        check_pair(job_id, group_id)
        self._note_call((group_id, job_id))
        async with self._lock(group_id):
            group_id = self._turn_lane(group_id, job_id)
            g = await self._group(group_id)
            turn = (group_id, g.token)
            info = g.release(job_id, token, rank, time.monotonic())
            if _lanes.is_lane(group_id) and info.group_released:  # its state is on this device now, only
                for other in _lanes.moved_in(self.groups, g, job_id):
                    await self.store.commit(other)
                    self._kick(other.group_id)
            slowest = max(self._turn_restores.pop(turn, 0.0), restore_seconds)
            for stale in [k for k in self._turn_restores if k[0] == group_id]:  # turns that ended otherwise
                del self._turn_restores[stale]
            if not info.group_released:
                self._turn_restores[turn] = slowest
            elif slowest > 0 and self.metrics is not None:
                self.metrics.restore_reported(group_id, slowest)
            if footprint_bytes > 0 and job_id in g.tenants:
                g.tenants[job_id].footprint_bytes = footprint_bytes
            await self.store.commit(g)
            self._yield_sent.discard((group_id, g.token))
            self._kick(group_id)
        return info

    @_whole
    async def evict(self, job_id: str, group_id: str, *, reason: str, lost: bool = False,
                    ended: bool = False) -> tuple[bool, bool]:
        """Take a job out of a group (scheduler saw it end, it died: ``lost``, or it closed its sessions: ``ended``);
        out of every lane of it too (a lane's id names its group)."""
        group_id = lane_base(group_id)
        check_pair(job_id, group_id)
        async with self._lock(group_id):
            g = await self._group(group_id)
            result = g.remove(job_id, time.monotonic(), lost=lost, ended=ended)
            for lane in _lanes.lanes_of(self.groups, group_id).values():  # and out of every device of the group
                if job_id in lane.tenants:
                    in_lane = lane.remove(job_id, time.monotonic(), lost=lost, ended=ended)
                    result = (result[0] or in_lane[0], result[1] or in_lane[1])
                    await self.store.commit(lane)
                    self._settle((lane.group_id, job_id), Unavailable(
                        f"job {job_id!r} was removed from group {group_id!r}: {reason}", job_id=job_id,
                        group_id=group_id))
                    self._kick(lane.group_id)
            inflight = self._prefetching.get(group_id)
            if (lost or ended) and inflight is not None and inflight[0] == job_id:  # a gone process frees its memory
                inflight[1].cancel()
            await self.store.commit(g)
            fut = self._grants.pop((group_id, job_id), None)
            if fut is not None and not fut.done():
                _fail(fut, Unavailable(f"job {job_id!r} was removed from group {group_id!r}: {reason}",
                                              job_id=job_id, group_id=group_id))
            self._kick(group_id)
        if any(result):  # a turn or a place taken away (not a job's own goodbye): what an operator looks for
            (log.info if ended else log.warning)("evicted job %s from group %s: %s", job_id, group_id, reason)
        return result

    async def status(self, group_id: str = "") -> list[GroupState]:
        if not group_id:
            return [self.groups[k] for k in sorted(self.groups)]
        check_id("group_id", group_id, group_id=group_id)
        async with self._lock(group_id):
            lanes = _lanes.lanes_of(self.groups, group_id)
            if lanes:
                plain = self.groups.get(group_id)
                return ([plain] if plain is not None else []) + [lanes[d] for d in sorted(lanes)]
            return [await self._group(group_id, create=False)]

    # ------------------------------------------------------------- sessions

    async def attach(self, job_id: str, group_id: str, rank: int, pid: int, footprint_bytes: int,
                     *, can_prefetch: bool = False, world_size: int = 1, resume: str = "") -> Session:
        """Register a tenant session; ``can_prefetch``: its client restores on a "restore" command;
        ``world_size``: ranks of the job (a job of several is aborted as a unit when one of them is lost);
        ``resume``: the secret of this rank's live session (``Session.resume``), which only the process that
        holds it can show: it alone may take that session over."""
        check_pair(job_id, group_id)
        if not 1 <= world_size <= MAX_WORLD_SIZE or not 0 <= rank < world_size:
            raise InvalidArgument(f"rank {rank} / world_size {world_size} is impossible (job={job_id!r}, "
                                  f"group={group_id!r}); need 0 <= rank < world_size <= {MAX_WORLD_SIZE}",
                                  job_id=job_id, group_id=group_id)
        if resume and (len(resume) != 32 or not all(c in "0123456789abcdef" for c in resume)):
            raise InvalidArgument(f"resume must be the 32 hex digits the orchestrator gave this rank's session "
                                  f"(got {len(resume)} characters); leave it empty on a first attach",
                                  job_id=job_id, group_id=group_id)
        key = (group_id, job_id)
        for old in self._live_sessions(key):  # one live session per rank: only its own process, with its secret,
            # takes it over (a reconnect)
            if old.rank != rank:
                continue
            if not (pid and old.pid == pid and resume and hmac.compare_digest(resume, old.resume)):
                raise AlreadyAttached(f"rank {rank} of job {job_id!r} in group {group_id!r} already has a live "
                                      "session from another process; a rank attaches once (close the other "
                                      "process, or wait for its TTL)", job_id=job_id, group_id=group_id)
            old.alive = False  # the same process reconnecting: its old stream is dead or dying
            self._sessions[key].remove(old)
            old.outbox.put_nowait(("close", "", 0))
        # The session counts from the moment it arrives, even if the group's lock is busy
        # (a slow commit): a job re-attaching after a restart must not miss its TTL waiting.
        s = Session(job_id, group_id, rank, pid, asyncio.Queue(), time.monotonic(), can_prefetch=can_prefetch,
                    world_size=world_size)
        self._sessions.setdefault(key, []).append(s)
        self._attached_once.add(key)
        self._called.pop(key, None)
        try:
            async with self._lock(group_id):
                g = await self._group(group_id)
                rec = g.tenant(job_id)
                rec.attached = True
                if footprint_bytes:
                    rec.footprint_bytes = footprint_bytes
        except BaseException:
            s.alive = False
            self._sessions[key].remove(s)
            if not self._sessions[key]:
                del self._sessions[key]
                self._attached_once.discard(key)
            raise
        return s

    def heartbeat(self, s: Session, footprint_bytes: int, memory: tuple[int, int, int] | None = None) -> None:
        """A session is alive; record its footprint and (host, spilled, residue) bytes."""
        s.last_seen = time.monotonic()
        g = self.groups.get(s.group_id)
        if g is None:
            return
        rec = g.tenant(s.job_id)
        if footprint_bytes:
            rec.footprint_bytes = footprint_bytes
        if memory is not None:
            s.memory = memory
            live = self._live_sessions((s.group_id, s.job_id))
            rec.host_bytes, rec.spilled_bytes, rec.residue_bytes = (sum(x.memory[i] for x in live) for i in range(3))

    def command_result(self, command_id: str, ok: bool, error: str, nbytes: int, seconds: float) -> None:
        fut = self._pending.pop(command_id, None)
        if fut is not None and not fut.done():
            fut.set_result((ok, error, nbytes, seconds))

    @_whole
    async def detach(self, s: Session, why: str, *, clean: bool = False) -> None:
        """A session ended. A job with no session left is gone: it loses everything, ``ended`` when its
        last session closed itself (``Gpu.close``), ``lost`` when it broke.

        A rank of a multi-rank job whose session broke (``clean`` False: its process died
        or went silent) ends the whole job at once; a rank that closed its session itself
        (``Gpu.close``) leaves the job to its other ranks.
        """
        if not s.alive:  # already judged (the watchdog's TTL, then the stream's end)
            return
        s.alive = False
        for cid in s.pending:  # a gone process holds no device memory: its park is moot
            fut = self._pending.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_result((True, "", 0, 0.0))
        key = (s.group_id, s.job_id)
        sessions = self._sessions.get(key, [])
        if s in sessions:
            sessions.remove(s)
        if not self._live_sessions(key):
            self._sessions.pop(key, None)
            self._attached_once.discard(key)
            await self.evict(s.job_id, s.group_id, reason=f"tenant session ended ({why})", lost=not clean,
                             ended=clean)
        elif s.world_size > 1 and not clean:  # the other ranks would wait for this one in a collective forever
            reason = f"rank {s.rank} (pid {s.pid}) of job {s.job_id!r} is gone ({why})"
            await self.evict(s.job_id, s.group_id, reason=reason, lost=True)
            self._abort_ranks(key, reason)

    @_whole
    async def fault_rank(self, s: Session, reason: str) -> None:
        """One rank of a job cannot go on (a failed restore, an error in its turn): FAULT the whole job.

        Its turn ends and it leaves the queue, so the group moves on instead of waiting
        for ranks stuck in a collective; every other rank of the job is told to abort.
        """
        cause = f"rank {s.rank} faulted: {reason}"
        async with self._lock(s.group_id):
            g = self.groups.get(self._turn_lane(s.group_id, s.job_id))
            if g is None or s.job_id not in g.tenants:
                return
            log.error("job %s in group %s: %s; job FAULTED as a unit", s.job_id, s.group_id, cause)
            self._fault(g, s.job_id, cause, f"job {s.job_id!r} in group {s.group_id!r} was faulted: {cause}; "
                        "restart every rank of the job")
            await self.store.commit(g)
            self._kick(s.group_id)
        self._abort_ranks((s.group_id, s.job_id), cause, but=s)

    def _abort_ranks(self, key: tuple[str, str], reason: str, *, but: Session | None = None) -> None:
        """Tell the live ranks of a job (except ``but``) that the job cannot go on as a unit."""
        for other in self._live_sessions(key):
            if other is not but:
                other.outbox.put_nowait(("abort", "", reason))

    def _live_sessions(self, key: tuple[str, str]) -> list[Session]:
        """Live sessions of (group, job); a lane's jobs are the group's (they attach to the group)."""
        return [s for s in self._sessions.get((lane_base(key[0]), key[1]), []) if s.alive]

    # ------------------------------------------------------------ internals

    def _lock(self, group_id: str) -> asyncio.Lock:
        group_id = lane_base(group_id)  # a group's lanes share its lock: a placement reads and moves across them
        lock = self._locks.get(group_id)
        if lock is None:
            lock = self._locks[group_id] = asyncio.Lock()
        return lock

    async def _group(self, group_id: str, *, create: bool | None = None) -> GroupState:
        g = self.groups.get(group_id)
        if g is not None:
            return g
        if create is None:
            create = self._may_create(group_id)
        if not create:
            why = ("this orchestrator serves a fixed list of groups (--groups)" if self.config.groups else
                   "a group exists from its first acquire until it has been idle for a while")
            # other groups are not named: their names are other teams' (rota status lists what a caller may see)
            raise NotFound(f"group {group_id!r} does not exist; {why}", group_id=group_id)
        g = GroupState(group_id, created=time.monotonic())
        await self.store.commit(g)
        self.groups[group_id] = g
        return g

    def _with_limits(self, grant: Grant) -> Grant:
        from dataclasses import replace

        return replace(grant, ttl_ms=int(self.config.ttl_s * 1000),
                       max_turn_ms=int(self.config.policy.max_turn_s * 1000))

    def _kick(self, group_id: str) -> None:
        task = self._drivers.get(group_id)
        if task is None or task.done():
            self._drivers[group_id] = asyncio.create_task(self._drive(group_id))

    async def _drive(self, group_id: str) -> None:
        """Grant the group to waiters, one after another, parking residents first."""
        while True:
            inflight = self._prefetching.get(group_id)
            if inflight is not None:  # let it finish: its job is then resident (or still parked), never half-way
                await asyncio.wait({inflight[1]})
                continue
            async with self._lock(group_id):
                g = self.groups.get(group_id)
                if g is not None and _lanes.is_lane(group_id) and not g.ready_for_grant():
                    await self._steal(g)  # an idle device takes a waiter another device's holder keeps waiting
                if g is None or not g.ready_for_grant():
                    if g is not None:
                        self._maybe_prefetch(g)
                    return
                chosen = self.config.policy.choose(g.grantable(), g.tenants, time.monotonic())
                if chosen is None:  # the policy holds the waiters back for now (e.g. resident-first)
                    recheck = float(getattr(self.config.policy, "recheck_s", 0.25))
                    asyncio.get_running_loop().call_later(recheck, self._kick, group_id)
                    self._maybe_prefetch(g)
                    return
                evict = self._begin_switch(g, chosen)
                others = [j for j in g.residents if j != chosen.job_id]
                incoming_parked = g.tenant(chosen.job_id).state == "parked"
            located: dict[str, str] = {}
            if self.agents is not None:  # which jobs an agent parks/restores (outside the lock)
                located = await self.agents.locate({*others, chosen.job_id})
                if not self.config.capacity_bytes:  # footprint unknown to us: park every agent-held resident
                    evict += [j for j in others if j in located and j not in evict]
            evict = [j for j in evict if j in located or self._live_sessions((group_id, j))]
            steps = [self._park(group_id, j, g.token, located.get(j, "")) for j in evict]
            restore_agent = located.get(chosen.job_id, "") if incoming_parked else ""
            if restore_agent:  # overlapped with the parks: both directions of PCIe at once
                steps.append(self.agents.run(restore_agent, "restore", chosen.job_id, group_id))  # type: ignore[union-attr]
            results = await asyncio.gather(*steps)
            async with self._lock(group_id):
                self._record_parks(g, evict, results)
                if restore_agent and self.metrics is not None:
                    self.metrics.restored(group_id, results[-1][0], results[-1][3])
                if restore_agent and not results[-1][0]:
                    error = results[-1][1]
                    log.error("restore of job %s in group %s by agent %s failed: %s; job FAULTED",
                              chosen.job_id, group_id, restore_agent, error)
                    self._fault(g, chosen.job_id, f"restore by agent {restore_agent} failed: {error}",
                                f"restore of job {chosen.job_id!r} in group {group_id!r} failed: {error}; acquire "
                                "again to retry")
                    await self.store.commit(g)
                if g.switching_to != chosen.job_id or g.queued(chosen.job_id) is None:
                    g.abort_switch()
                    continue
                grant = g.complete_grant(time.monotonic(), prefetch=self.config.prefetch_on)
                if self.metrics is not None:
                    self.metrics.granted(group_id, grant.waited_ms / 1000.0)
                try:
                    await self.store.commit(g)
                except RotaError as exc:  # not durable: undo nothing visible, fail the waiter
                    log.error("could not commit grant of %s to %s: %s", grant.job_id, group_id, exc)
                    self._settle((group_id, grant.job_id), exc)
                    return
                self._settle((group_id, grant.job_id), grant)

    async def _steal(self, lane: GroupState) -> None:
        """Under the lock: idle ``lane`` takes a waiter of a busy lane that fits here (:func:`.lanes.steal`);
        its pending acquire now waits for this lane."""
        stolen = _lanes.steal(self.groups, lane, self.config.capacity_bytes, time.monotonic())
        if stolen is None:
            return
        job, left = stolen
        fut = self._grants.pop((left, job), None)
        if fut is not None:
            self._grants[(lane.group_id, job)] = fut
        await self.store.commit(self.groups[left])
        await self.store.commit(lane)
        log.info("job %s in group %s: waited for %s, moves to idle %s", job, lane_base(lane.group_id),
                 lane_device(left), lane_device(lane.group_id))

    async def agent_job_states(self, group_id: str) -> list[tuple[str, str, str]]:
        """(agent, JobState name, job) for every job of ``group_id`` that an agent knows."""
        if self.agents is None:
            return []
        g = self.groups.get(group_id)
        jobs = set(g.tenants) if g is not None else set()
        return [t for t in await self.agents.job_states() if t[2] in jobs]

    def _maybe_prefetch(self, g: GroupState) -> None:
        """Start restoring the job the policy would grant next, if it is parked and fits
        beside every resident. Called by the group's driver, under the group's lock."""
        if not self.config.prefetch_on or not g.holder or not g.grantable() or g.group_id in self._prefetching \
                or _lanes.is_lane(g.group_id):  # a lane's prefetch would restore on the device it left: none yet
            return
        chosen = self.config.policy.choose(g.grantable(), g.tenants, time.monotonic())
        if chosen is None:
            return
        job = chosen.job_id
        if (g.group_id, job, g.token) in self._prefetch_failed or \
                g.prefetch_plan(job, self.config.capacity_bytes) is None:
            return
        self._prefetch_failed = {k for k in self._prefetch_failed if k[0] != g.group_id or k[2] == g.token}
        task = asyncio.create_task(self._prefetch(g.group_id, job))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged inside; never "unretrieved"
        self._prefetching[g.group_id] = (job, task)

    async def _prefetch(self, group_id: str, job_id: str) -> None:
        """Restore ``job_id`` ahead of its grant (agent or sessions); RPCs run outside the lock."""
        capacity = self.config.capacity_bytes
        try:
            async with self._lock(group_id):
                plan = self.groups[group_id].prefetch_plan(job_id, capacity) or []
            located = await self.agents.locate({job_id, *plan}) if self.agents is not None else {}
            agent = located.get(job_id, "")
            async with self._lock(group_id):
                g = self.groups[group_id]
                sessions = self._live_sessions((group_id, job_id))
                by_session = bool(sessions) and all(s.can_prefetch for s in sessions)
                plan = g.prefetch_plan(job_id, capacity)  # type: ignore[assignment]
                if not (agent or by_session) or plan is None or \
                        not all(j in located or self._live_sessions((group_id, j)) for j in plan):
                    return  # nobody can restore it early or park what is in the way, or it no longer fits / waits
                token = g.token
                log.info("prefetch: restoring job %s in group %s while %s holds it (%s)%s", job_id, group_id,
                         g.holder or "nobody", f"agent {agent}" if agent else "its client",
                         f", after parking idle {plan}" if plan else "")
            if plan:  # make room first: idle residents go to the host during the holder's turn too
                results = await asyncio.gather(*(self._park(group_id, j, token, located.get(j, "")) for j in plan))
                async with self._lock(group_id):
                    g = self.groups[group_id]
                    self._record_parks(g, plan, results)
                    await self.store.commit(g)
                    if g.prefetch_plan(job_id, capacity) != []:
                        return  # still no room (a park failed, or things changed): the grant will switch
            if agent:
                ok, error, _, seconds = await self.agents.run(agent, "restore", job_id, group_id)  # type: ignore[union-attr]
            else:
                ok, error, _, seconds = await self._session_command(group_id, job_id, "restore", token)
            if self.metrics is not None:
                self.metrics.restored(group_id, ok, seconds)
            async with self._lock(group_id):
                self._prefetched(self.groups[group_id], job_id, agent, ok, error, seconds)
                await self.store.commit(self.groups[group_id])
        except asyncio.CancelledError:
            log.info("prefetch of job %s in group %s cancelled (the job ended)", job_id, group_id)
        except Exception:  # a bug here must not stall the group: its driver waits for this task
            log.exception("prefetch of job %s in group %s failed unexpectedly; it stays parked", job_id, group_id)
        finally:
            if self._prefetching.get(group_id, ("", None))[1] is asyncio.current_task():
                del self._prefetching[group_id]

    def _record_parks(self, g: GroupState, jobs: list[str], results: list[tuple[bool, str, int, float]]) -> None:
        """Record finished parks (under the lock): parked, or FAULTED with the cause; extra results are ignored.

        A faulted job leaves the queue, so an acquire it has pending there (a resident
        waits for its next turn while others run) fails with the cause instead of
        waiting for a grant that can no longer come; acquiring again retries.
        """
        for job, (ok, error, nbytes, seconds) in zip(jobs, results, strict=False):
            if self.metrics is not None:
                self.metrics.parked(g.group_id, ok, nbytes, seconds)
            if ok:
                g.mark_parked(job, nbytes, seconds)
                continue
            log.error("park of job %s in group %s failed: %s; job FAULTED", job, g.group_id, error)
            self._fault(g, job, f"park failed: {error}", f"park of job {job!r} in group {g.group_id!r} failed: "
                        f"{error}; its state was left in place; acquire again to retry")

    def _fault(self, g: GroupState, job_id: str, cause: str, message: str) -> None:
        """Take a job out of the group as FAULTED with ``cause`` (under the lock), and fail an
        acquire it has pending with ``message``: FAULTED is retryable by acquiring again."""
        g.remove(job_id, time.monotonic(), lost=True)
        g.tenant(job_id).state, g.tenant(job_id).fault = "faulted", cause
        fut = self._grants.pop((g.group_id, job_id), None)
        if fut is not None and not fut.done():
            _fail(fut, Faulted(message, job_id=job_id, group_id=g.group_id))

    def _prefetched(self, g: GroupState, job_id: str, agent: str, ok: bool, error: str, seconds: float) -> None:
        """Record a prefetch's outcome (under the lock), as a restore of the same kind would."""
        rec = g.tenant(job_id)
        if rec.state in ("faulted", *GONE):
            log.info("prefetch of job %s in group %s ignored: the job is %s", job_id, g.group_id, rec.state)
            return
        if ok:
            if g.queued(job_id) is not None:
                g.mark_prefetched(job_id)
            else:  # left the queue while its restore ran, but it is alive and on the device now
                if job_id not in g.residents:
                    g.residents.append(job_id)
                rec.state = "resident"
            log.info("prefetch: job %s in group %s restored in %.3f s, before its grant", job_id, g.group_id, seconds)
            return
        g.prefetch_failures += 1
        self._prefetch_failed.add((g.group_id, job_id, g.token))
        if not agent:  # the client rolled its restore back: still parked; it restores itself at its grant
            log.warning("prefetch of job %s in group %s failed: %s; it stays parked", job_id, g.group_id, error)
            return
        log.error("prefetch of job %s in group %s by agent %s failed: %s; job FAULTED", job_id, g.group_id, agent,
                  error)
        self._fault(g, job_id, f"restore (prefetch) by agent {agent} failed: {error}",
                    f"restore of job {job_id!r} in group {g.group_id!r} failed: {error}; acquire again to retry")

    async def _park(self, group_id: str, job_id: str, token: int, agent: str = "") -> tuple[bool, str, int, float]:
        """Ask every rank of a resident job to park (or its agent); wait for all acknowledgements."""
        if agent and self.agents is not None:
            return await self.agents.run(agent, "snapshot", job_id, lane_base(group_id))
        return await self._session_command(group_id, job_id, "park", token)

    async def _session_command(self, group_id: str, job_id: str, kind: str, token: int
                               ) -> tuple[bool, str, int, float]:
        """Send ``kind`` ("park" or "restore") to every live rank of a job; wait for all acknowledgements."""
        sessions = self._live_sessions((group_id, job_id))
        futs, sent = [], []
        loop = asyncio.get_running_loop()
        for s in sessions:
            cid = uuid.uuid4().hex
            fut = self._pending[cid] = loop.create_future()
            futs.append(fut)
            sent.append((s, cid))
            s.pending.add(cid)
            s.outbox.put_nowait((kind, cid, token))
        try:
            done = await asyncio.wait_for(asyncio.gather(*futs), self.config.park_timeout_s)
        except asyncio.TimeoutError:
            return False, f"no {kind} acknowledgement within {self.config.park_timeout_s:g} s", 0, 0.0
        finally:  # answered, timed out or cancelled: nothing waits for these any more
            for s, cid in sent:
                s.pending.discard(cid)
                self._pending.pop(cid, None)
        errors = [e for ok, e, _, _ in done if not ok]
        if errors:
            return False, "; ".join(errors), 0, 0.0
        return True, "", sum(d[2] for d in done), max((d[3] for d in done), default=0.0)

    async def _watchdog(self) -> None:
        period = min(0.25, self.config.ttl_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                await self._check_liveness()
            except Exception:  # the watchdog must outlive any one bad check
                log.exception("watchdog check failed")

    async def _collect(self, now: float) -> None:
        """Forget tenants that ended long ago and groups with nothing in them (bounded memory and Status)."""
        cfg = self.config
        busy: dict[str, set[str]] = {}  # group -> jobs with a live session or a pending acquire (one pass)
        for (gid, job), ss in self._sessions.items():
            if ss:
                busy.setdefault(gid, set()).add(job)
        for gid, job in self._grants:
            busy.setdefault(gid, set()).add(job)
        for g in list(self.groups.values()):
            if lane_base(g.group_id) in cfg.groups:
                continue
            keep = busy.get(lane_base(g.group_id), set())
            if cfg.ended_tenant_ttl_s and any(now - r.last_active > cfg.ended_tenant_ttl_s for r in g.tenants.values()):
                async with self._lock(g.group_id):
                    gone = g.collect(now, cfg.ended_tenant_ttl_s, keep=keep)
                    if gone:
                        await self.store.commit(g)
                        if self.metrics is not None:
                            self.metrics.collected(g.group_id, len(gone))
            idle = g.idle_since()
            if not cfg.idle_group_ttl_s or idle is None or keep or now - idle <= cfg.idle_group_ttl_s:
                continue
            async with self._lock(g.group_id):
                if g.idle_since() is None or self.groups.get(g.group_id) is not g:
                    continue
                delete = getattr(self.store, "delete", None)  # optional: a store that cannot forget keeps it
                if delete is not None:
                    await delete(g.group_id)
                del self.groups[g.group_id]
                if self.metrics is not None:
                    self.metrics.forget(g.group_id)  # its series go with it
            self._drivers.pop(g.group_id, None)
            if not _lanes.is_lane(g.group_id):
                self._locks.pop(g.group_id, None)
            log.info("group %s had nothing in it for %.0f s: forgotten", g.group_id, now - idle)

    async def _check_liveness(self) -> None:
        now = time.monotonic()
        for key, sessions in list(self._sessions.items()):
            for s in list(sessions):
                if now - s.last_seen > self.config.ttl_s:
                    log.warning("job %s rank %d in group %s: no heartbeat for %.1f s (TTL %.1f s)",
                                s.job_id, s.rank, s.group_id, now - s.last_seen, self.config.ttl_s)
                    s.outbox.put_nowait(("close", "", 0))
                    await self.detach(s, "heartbeat TTL expired")
            if not sessions and key in self._attached_once:  # restarted: never re-attached
                since = max(getattr(self, "_started", now), self._called.get(key, 0.0))
                if now - since > self.config.ttl_s:
                    self._attached_once.discard(key)
                    self._sessions.pop(key, None)
                    self._called.pop(key, None)
                    await self.evict(key[1], key[0], reason="did not re-attach within TTL", lost=True)
        for g in list(self.groups.values()):
            if not g.holder:
                continue
            held = now - g.holder_since
            key = (g.group_id, g.holder)
            limit = self.config.policy.max_turn_s
            if limit and held > limit and g.grantable() and (g.group_id, g.token) not in self._yield_sent:
                self._yield_sent.add((g.group_id, g.token))
                for s in self._live_sessions(key):
                    s.outbox.put_nowait(("yield", uuid.uuid4().hex, g.token))
            v1_limit = self.config.v1_max_turn_s
            if v1_limit and held > v1_limit and (lane_base(key[0]), key[1]) not in self._attached_once:
                await self.evict(g.holder, g.group_id, reason=f"turn exceeded --v1-max-turn {v1_limit:g} s")
        await self._collect(now)
        busy = any(g.holder or g.queue for g in self.groups.values()) or any(self._sessions.values())
        if busy:
            self._idle_since = now
        elif self.config.idle_exit_s and now - self._idle_since > self.config.idle_exit_s:
            log.info("idle for %.0f s: exiting", self.config.idle_exit_s)
            self.stopped.set()


def _agents_from_env() -> tuple[str, ...]:
    return tuple(a.strip() for a in os.environ.get("ROTA_AGENTS", "").split(",") if a.strip())


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
        self._token: tuple[float, tuple[tuple[str, str], ...]] = (0.0, ())

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """``authorization`` for the agents: an admin token of audience ``rota-agent`` (which orchestrators refuse,
        so one read off an agent link acts nowhere else) from the orchestrator's own key (none without one)."""
        if self._auth_key is None:
            return ()
        minted, metadata = self._token
        if time.monotonic() - minted > self.TOKEN_TTL_S / 2:
            from rota import auth

            metadata = auth.bearer(auth.issue(self._auth_key, admin=True, ttl_s=self.TOKEN_TTL_S,
                                              audience=auth.AGENT_AUDIENCE))
            self._token = (time.monotonic(), metadata)
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
                                                   metadata=self._metadata())
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
                                             timeout=self.timeout_s, metadata=self._metadata())).operation_id
            else:
                op_id = (await stub.Restore(spb.RestoreRequest(job_id=job_id, group=group_id),
                                            timeout=self.timeout_s, metadata=self._metadata())).operation_id
            while True:
                op = await stub.GetOperation(spb.GetOperationRequest(operation_id=op_id),
                                             timeout=max(0.1, deadline - time.monotonic()),
                                             metadata=self._metadata())
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


MAX_WEIGHT = 1e6
MAX_BYTES = 1 << 50  # a byte count from a caller (footprint, host memory): 1 PiB
MAX_WORLD_SIZE = 1024  # ranks of one job, and so its sessions (one per rank): 2,862 from one token ended INTERNAL


def check_bytes(name: str, value: int) -> int:
    """A byte count from a caller: >= 0 and at most :data:`MAX_BYTES`."""
    if not 0 <= value <= MAX_BYTES:
        raise InvalidArgument(f"{name} {value} must be between 0 and {MAX_BYTES} bytes")
    return value


def _check_request(req: TurnRequest) -> None:
    """Every number of an acquire bounded: impossible ranks, extreme priorities, NaN or infinite weights refused."""
    where = f"(job={req.job_id!r}, group={req.group_id!r})"
    if not 0 <= req.world_size <= MAX_WORLD_SIZE or (req.world_size and not 0 <= req.rank < req.world_size):
        raise InvalidArgument(f"rank {req.rank} / world_size {req.world_size} is impossible {where}; "
                              f"need 0 <= rank < world_size <= {MAX_WORLD_SIZE}")
    if not MIN_PRIORITY <= req.priority <= MAX_PRIORITY:
        raise InvalidArgument(f"priority {req.priority} is out of range {where}; use {MIN_PRIORITY}..{MAX_PRIORITY}")
    if not math.isfinite(req.weight) or not 0 < req.weight <= MAX_WEIGHT:
        raise InvalidArgument(f"weight {req.weight!r} must be a finite number in (0, {MAX_WEIGHT:g}] {where}")
    check_bytes("footprint_bytes", req.footprint_bytes)
    if req.devices:
        if len(req.devices) > MAX_DEVICES:
            raise InvalidArgument(f"{len(req.devices)} devices named {where}; at most {MAX_DEVICES}")
        if tuple(parse_devices(list(req.devices), "devices")) != tuple(req.devices):
            raise InvalidArgument(f"devices {req.devices!r} are not canonical names {where}; send cuda:N or fake:N")
        if req.world_size > 1:
            raise InvalidArgument(f"a job of {req.world_size} ranks keeps its devices (each rank its own, bound to "
                                  f"its collectives) {where}; name no devices for it (unset ROTA_DEVICES)")


__all__ = ["AgentLinks", "Faulted", "GroupStore", "MemoryStore", "Orchestrator", "OrchestratorConfig", "Session"]
