"""Tenant sessions (``rota.v1.RotaService/Attach``): one per rank of a job, its liveness and its commands.

:class:`Session` is one attached tenant process; :class:`TenantSessions` is the part of
:class:`~rota._orchestrator.turns.Orchestrator` that attaches, hears and detaches them, judges a
job alive, aborts or faults a job's ranks as a unit, and sends a job's ranks a park or
restore command and waits for every acknowledgement. It is a mixin: the state it uses
(``_sessions``, ``_pending``, ``groups``, ...) is made by ``Orchestrator.__init__``.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets
import time
import uuid
from dataclasses import dataclass, field

from rota._ids import check_pair
from rota._orchestrator.config import MAX_WORLD_SIZE
from rota._orchestrator.futures import whole
from rota.devices import lane_base
from rota.errors import AlreadyAttached, InvalidArgument

log = logging.getLogger(__name__)


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
    memory: tuple[int, int, int] = (0, 0, 0)  # host, spilled, residue bytes as last reported
    can_prefetch: bool = False  # its client restores parked state on a "restore" command (ahead of its grant)
    world_size: int = 1  # ranks of its job: losing one of several ends the whole job's turn
    said_goodbye: bool = False  # the tenant closed the session on purpose (a dead process cannot)
    resume: str = field(default_factory=lambda: secrets.token_hex(16))  # shown again to take this session over
    residue_capped: bool = False  # its job's reported residue was capped (logged once)


class TenantSessions:
    """The sessions part of the orchestrator (a mixin of :class:`~rota._orchestrator.turns.Orchestrator`)."""

    def close_sessions(self) -> None:
        """Close every tenant's session stream, so tenants re-attach elsewhere (e.g. to the next leader)."""
        for sessions in list(self._sessions.values()):
            for s in sessions:
                s.outbox.put_nowait(("close", "", 0))

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
        """A session is alive; record its footprint and (host, spilled, residue) bytes (None: unchanged, e.g. a
        heartbeat repeating none, or a command result without them)."""
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
            rec.host_bytes, rec.spilled_bytes, residue = (sum(x.memory[i] for x in live) for i in range(3))
            rec.residue_bytes = self._counted_residue(s, residue, rec.footprint_bytes)

    def _counted_residue(self, s: Session, reported: int, footprint: int) -> int:
        """The part of a job's reported residue that counts against the other tenants' room: at most
        ``residue_allowance_bytes``, the device's size and the job's own footprint (its park cannot leave more
        on the device than it had there). The rest is the tenant's own word: it counts for nobody, so a tenant
        that reports more than it could leave makes no neighbour park (logged once per session)."""
        bounds = [self.config.residue_allowance_bytes] + [b for b in (self.config.capacity_bytes, footprint) if b > 0]
        counted = min(reported, *bounds)
        if counted < reported and not s.residue_capped:
            s.residue_capped = True
            log.warning("job %s rank %d in group %s reports %d bytes of residue; %d counted against the other "
                        "tenants (at most --residue-allowance %d, the device's size and the job's footprint)",
                        s.job_id, s.rank, s.group_id, reported, counted, self.config.residue_allowance_bytes)
        return counted

    def command_result(self, command_id: str, ok: bool, error: str, nbytes: int, seconds: float) -> None:
        fut = self._pending.pop(command_id, None)
        if fut is not None and not fut.done():
            fut.set_result((ok, error, nbytes, seconds))

    @whole
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

    @whole
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
        try:  # asyncio.wait, not wait_for(gather(...)): cancelled (the orchestrator stopping mid-park), that
            # left a gathering future whose CancelledError nobody retrieved, logged at exit after everything else
            _, late = await asyncio.wait(futs, timeout=self.config.park_timeout_s) if futs else (set(), set())
        finally:  # answered, timed out or cancelled: nothing waits for these any more
            for s, cid in sent:
                s.pending.discard(cid)
                self._pending.pop(cid, None)
        if late:
            return False, f"no {kind} acknowledgement within {self.config.park_timeout_s:g} s", 0, 0.0
        done = [f.result() for f in futs]
        errors = [e for ok, e, _, _ in done if not ok]
        if errors:
            return False, "; ".join(errors), 0, 0.0
        return True, "", sum(d[2] for d in done), max((d[3] for d in done), default=0.0)


__all__ = ["Session", "TenantSessions"]
