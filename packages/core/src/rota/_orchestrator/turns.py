"""The orchestrator's turns: acquires, releases, evictions and the watchdog, over group state in a store.

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

The parts of :class:`Orchestrator` live beside it: :mod:`.sessions` (tenant sessions),
:mod:`.driver` (switches, node agents and prefetch: read there how they work), :mod:`.store`,
:mod:`.config` and :mod:`.agents`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any

from rota._ids import check_id, check_pair
from rota._orchestrator import lanes as _lanes
from rota._orchestrator.agents import AgentLinks
from rota._orchestrator.config import OrchestratorConfig, check_request
from rota._orchestrator.driver import GroupDriver
from rota._orchestrator.futures import fail, whole
from rota._orchestrator.sessions import Session, TenantSessions
from rota._orchestrator.state import GroupState
from rota._orchestrator.store import GroupStore, MemoryStore
from rota._types import Grant, ReleaseInfo, TurnRequest
from rota.devices import FAKE_DEVICES, MAX_DEVICES, device_index, host_gpus, lane_base, lane_device
from rota.errors import InvalidArgument, NotFound, RotaError, Unavailable

log = logging.getLogger(__name__)


class Orchestrator(TenantSessions, GroupDriver):
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
        self._host_devices: int | None = None  # GPUs lanes may name (counted at the first lane's acquire)
        self.stopped = asyncio.Event()
        self.metrics: Any = None  # an OrchestratorMetrics when /metrics is served (report_metrics_to)
        self.agents = AgentLinks(self.config.agents, self.config.park_timeout_s, auth_key=self.config.agent_auth_key,
                                 tls=self.config.agent_tls) if self.config.agents else None

    # ------------------------------------------------------------- lifecycle

    @property
    def leading(self) -> bool:
        """Always True: this orchestrator grants the turns of every group it has."""
        return True

    def report_health_to(self, health: Any) -> None:
        """Nothing to report: this orchestrator always answers and leads, so every health name stays SERVING."""

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

    async def stop(self) -> None:
        self.stopped.set()  # first: an acquire committing meanwhile then fails instead of waiting forever
        for t in self._tasks + list(self._drivers.values()) + [t for _, t in self._prefetching.values()]:
            t.cancel()
        for fut in self._grants.values():
            if not fut.done():
                fail(fut, Unavailable("orchestrator is shutting down; retry against its successor"))
        if self.agents is not None:
            await self.agents.close()

    # ------------------------------------------------------------------ API

    async def acquire(self, req: TurnRequest) -> Grant:
        """Block until ``req.job_id`` holds ``req.group_id``."""
        check_pair(req.job_id, req.group_id)
        check_request(req)
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

    @whole
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
            if any(_lanes.in_use(g) for g in lanes.values()):  # jobs on its devices now: not a lane left behind
                raise InvalidArgument(f"group {req.group_id!r} spans devices now (tenants that name them in "
                                      f"ROTA_DEVICES are on them), but this acquire names none {where}; give every "
                                      "tenant of the group ROTA_DEVICES, or none")
            return req
        self._check_devices(req.devices, where)
        if plain is not None and _lanes.in_use(plain):
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

    def _check_devices(self, devices: list[str] | tuple[str, ...], where: str) -> None:
        """InvalidArgument unless every one of ``devices`` exists on the host (a lane of a device nobody has would
        hold the group's name for nothing): cuda:N below ``config.devices``, else below this host's GPUs, or
        below MAX_DEVICES on a host without any (it serves the GPUs of other hosts, whose count it cannot see)."""
        if self._host_devices is None:
            self._host_devices = self.config.devices if self.config.devices is not None else host_gpus()
        for d in devices:
            kind = d.partition(":")[0]
            if self.config.devices is not None:
                have, basis = self.config.devices, f"--devices {self.config.devices}"
            elif kind == "fake":
                have, basis = FAKE_DEVICES, f"{FAKE_DEVICES} fake devices"
            elif self._host_devices:
                have, basis = self._host_devices, f"{self._host_devices} GPUs in /dev/nvidia*"
            else:
                have, basis = MAX_DEVICES, f"no GPUs here, so any of {MAX_DEVICES}"
            if device_index(d) < have:
                continue
            has = f"{kind}:0..{kind}:{have - 1}" if have else f"no {kind} devices"
            raise InvalidArgument(f"device {d} does not exist on this host (it has {has}: {basis}) {where}; name "
                                  "devices the host has (ROTA_DEVICES), or start the orchestrator with --devices N "
                                  "where it serves the GPUs of another host")

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
        no prefetch runs, the policy picks this job, no state moving out of the lane is in the way, and no
        resident has to be parked (no agents to ask).

        Its caller then commits the enqueue and the grant together (one etcd transaction for a tenant alone
        in its group, not two); otherwise (None) the group's driver grants as usual.
        """
        if self.agents is not None or g.group_id in self._prefetching or not g.ready_for_grant():
            return None
        chosen = self.config.policy.choose(g.grantable(), g.tenants, time.monotonic())
        if chosen is None or chosen.job_id != job_id or \
                _lanes.grant_waits_for_move(self.groups, g, job_id, self.config.capacity_bytes):
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
            fail(fut, outcome)
        else:
            fut.set_result(outcome)

    @whole
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
            self._kick_left_behind(g, job_id)

    @whole
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
            self._kick_left_behind(g, job_id)

    @whole
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

    @whole
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
                    if _lanes.emptied(lane):  # its last job left: the lane goes with it, deciding nothing more
                        await self._forget(lane)
            inflight = self._prefetching.get(group_id)
            if (lost or ended) and inflight is not None and inflight[0] == job_id:  # a gone process frees its memory
                inflight[1].cancel()
            await self.store.commit(g)
            fut = self._grants.pop((group_id, job_id), None)
            if fut is not None and not fut.done():
                fail(fut, Unavailable(f"job {job_id!r} was removed from group {group_id!r}: {reason}",
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

    async def _forget(self, g: GroupState) -> None:
        """Forget group (or lane) ``g``, under its lock: out of the store, memory and metrics."""
        delete = getattr(self.store, "delete", None)  # optional: a store that cannot forget keeps it
        if delete is not None:
            await delete(g.group_id)
        if self.groups.get(g.group_id) is g:
            del self.groups[g.group_id]
        if self.metrics is not None:
            self.metrics.forget(g.group_id)  # its series go with it
        self._drivers.pop(g.group_id, None)

    def _with_limits(self, grant: Grant) -> Grant:
        from dataclasses import replace

        return replace(grant, ttl_ms=int(self.config.ttl_s * 1000),
                       max_turn_ms=int(self.config.policy.max_turn_s * 1000))

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
                        if _lanes.is_lane(g.group_id) and g.ready_for_grant():  # residue it waited for may be gone
                            self._kick(g.group_id)
                        if self.metrics is not None:
                            self.metrics.collected(g.group_id, len(gone))
            idle = g.idle_since()
            if not cfg.idle_group_ttl_s or idle is None or keep or now - idle <= cfg.idle_group_ttl_s:
                continue
            async with self._lock(g.group_id):
                if g.idle_since() is None or self.groups.get(g.group_id) is not g:
                    continue
                await self._forget(g)
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


__all__ = ["Orchestrator"]
