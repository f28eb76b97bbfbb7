"""One orchestrator replica: campaigns for leadership and serves while it leads.

``rota orchestrator serve --etcd URL`` serves the :class:`Replica` that this plugin's
``rota_orchestrator`` hook returns, where it would serve core's own: both are
:class:`rota.orchestrator.OrchestratorProtocol`.
Each replica:

* campaigns (:mod:`rota_etcd._election`); while another replica leads it answers
  Acquire, Yield, Release, Evict and Attach with UNAVAILABLE naming the leader
  (:class:`rota.errors.NotLeader`; rota clients follow it) and serves status reads
  from etcd;
* reports through grpc.health.v1: the orchestrator services are SERVING while it
  answers calls — it leads, or it follows a leader it knows (readiness: a Service may
  send clients to any ready replica) — and ``rota.leader`` is SERVING only while it
  leads (:meth:`Replica.health_states`);
* when it wins a term, loads every group from etcd into a fresh
  :class:`EtcdOrchestrator` (core's orchestrator, writing through a term-bound store)
  and serves from it;
* when the term ends — lease lost, lease not refreshed in time, a commit refused or
  failed, etcd unreachable — drops that orchestrator with all its memory (blocked
  Acquires get UNAVAILABLE and are re-sent by their clients with the same job id,
  keeping their place, which lives in etcd), closes tenant sessions (they re-attach
  to the next leader) and campaigns again.

Environment:
    ROTA_ADVERTISE   HOST:PORT that clients are sent to when this replica leads
                     (default: --listen, with a wildcard host replaced by this host's IP)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import socket
import uuid
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from rota.config import check_pair
from rota.errors import NotLeader, RotaError, Unavailable
from rota.orchestrator import GroupState, Orchestrator, OrchestratorConfig, Session
from rota.types import Grant, ReleaseInfo, TurnRequest
from rota_etcd._election import Election
from rota_etcd._shards import assign
from rota_etcd._store import EtcdStore, Term, TermStore

log = logging.getLogger(__name__)


def advertised_address(listen: str) -> str:
    """The address clients should use for a replica listening on ``listen``."""
    explicit = os.environ.get("ROTA_ADVERTISE", "").strip()
    if explicit:
        return explicit
    host, _, port = listen.rpartition(":")
    if host in ("0.0.0.0", "[::]", "::", ""):
        try:
            host = socket.gethostbyname(socket.gethostname())
        except OSError:
            host = "127.0.0.1"
    return f"{host}:{port}"


class EtcdOrchestrator(Orchestrator):
    """Core's orchestrator for one leadership term, with etcd-backed turn leases.

    Every grant is tied to the turn lease its commit creates (see
    :mod:`rota_etcd._store`). The lease is refreshed while the holder is alive —
    its sessions heartbeat within the TTL, or it never opened a session (a
    v1alpha1-only client, bounded by ``--v1-max-turn``) — and when etcd expires it
    the turn ends and the job's state is marked lost.
    """

    store: TermStore

    def __init__(self, config: OrchestratorConfig, store: TermStore, *, name: str) -> None:
        super().__init__(config, store, name=name)
        self._turn_task: asyncio.Task | None = None

    async def start(self) -> None:
        await super().start()
        self.store.watch_turns(self._turn_expired)
        self._turn_task = asyncio.create_task(self._keep_turns(), name="rota-etcd-turns")

    async def stop(self) -> None:
        if self._turn_task is not None:
            self._turn_task.cancel()
        await super().stop()
        await self.store.close()

    async def acquire(self, req: TurnRequest) -> Grant:
        g = self.groups.get(req.group_id)
        again = g is not None and g.holder == req.job_id
        grant = await super().acquire(req)
        if again:  # answered from memory: prove this term still leads before saying "yes"
            await self.store.verify(req.group_id)
        return grant

    async def _keep_turns(self) -> None:
        while True:
            for g in list(self.groups.values()):
                if g.holder:
                    self.store.keep_turn(g.group_id, self.job_alive(g.group_id, g.holder))
            await asyncio.sleep(min(0.25, self.config.ttl_s / 4))

    async def _turn_expired(self, group_id: str, job_id: str, token: int) -> None:
        g = self.groups.get(group_id)
        if g is None or g.holder != job_id or g.token != token:
            return  # our own release or a later turn: nothing to do
        log.warning("turn %d of job %s in group %s: its etcd lease expired; the turn ends", token, job_id, group_id)
        with contextlib.suppress(RotaError):
            await self.evict(job_id, group_id, reason="its turn lease expired in etcd (no keepalive within the TTL)",
                             lost=True)


@dataclass
class _Shard:
    """One shard of the groups as this replica sees it: its election, and its orchestrator while leading it."""

    index: int
    election: Election
    orch: EtcdOrchestrator | None = None
    term: Term | None = None

    @property
    def leading(self) -> bool:
        return self.orch is not None and self.term is not None and not self.term.lost.is_set()


class Replica:
    """An orchestrator replica (:class:`rota.orchestrator.OrchestratorProtocol`).

    With ``ROTA_ETCD_SHARDS`` N > 1 it campaigns for each of the N shards (first for
    those :func:`rota_etcd._shards.assign` gives it among the live replicas, after
    :data:`rota_etcd._election.DEFER_S` for the others), leads each shard it wins
    with an orchestrator of its own, gives shards not assigned to it back while it leads
    more than its share (a replica joined), and redirects calls for the other
    shards' groups to their leaders.
    """

    MEMBER_POLL_S = 0.5  # how often the live replicas are re-read

    def __init__(self, store: EtcdStore, config: OrchestratorConfig, *, listen: str,
                 advertise: str | None = None) -> None:
        config.check()
        self.store, self.config, self.listen = store, config, listen
        self.address = advertise or advertised_address(listen)
        self.id = f"{socket.gethostname().split('.')[0]}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.identity = {"id": self.id, "address": self.address, "host": socket.gethostname(), "pid": os.getpid()}
        self.shards = [_Shard(i, Election(store, self.identity, store.shard_leader_key(i)))
                       for i in range(store.shards)]
        self.members: list[str] = [self.id]  # live replica ids (this one until etcd says more)
        self.stopped = asyncio.Event()
        self._owner: weakref.WeakKeyDictionary[Session, EtcdOrchestrator] = weakref.WeakKeyDictionary()
        self._tasks: list[asyncio.Task] = []
        self._published: tuple[bool, bool] | None = None
        self._member_lease = 0
        self.health: Any = None  # grpc.health.v1 servicer (report_health_to)
        self.metrics: Any = None  # handed to each term's orchestrator (report_metrics_to)

    @property
    def election(self) -> Election:
        return self.shards[0].election

    @property
    def groups(self) -> dict[str, GroupState]:
        """The groups of every shard this replica leads."""
        out: dict[str, GroupState] = {}
        for sh in self.shards:
            if sh.orch is not None:
                out.update(sh.orch.groups)
        return out

    @property
    def name(self) -> str:
        led = [sh for sh in self.shards if sh.leading]
        if not led:
            return f"etcd follower {self.address}"
        if len(self.shards) == 1:
            return f"etcd leader (term {led[0].term.revision}) {self.address}"  # type: ignore[union-attr]
        return f"etcd leader of {len(led)}/{len(self.shards)} shards {self.address}"

    @property
    def leader_address(self) -> str:
        return (self.election.leader or {}).get("address", "")

    # ------------------------------------------------------------ lifecycle

    def report_health_to(self, health: Any) -> None:
        """Keep ``health`` true from :meth:`start` on: services NOT_SERVING while no leader is known,
        ``rota.leader`` NOT_SERVING while this replica follows (see :meth:`health_states`)."""
        self.health = health

    def report_metrics_to(self, metrics: Any) -> None:
        """Feed ``metrics`` from the orchestrator of every term this replica leads."""
        self.metrics = metrics

    async def start(self) -> None:
        """Check that etcd answers (a clear error naming the endpoints if not), then
        campaign in the background; serving starts at once, as a follower."""
        await self.store.connect()
        await self.store.check_shards()
        await self._publish_health()
        if len(self.shards) > 1:
            await self._refresh_members()
            self._tasks.append(asyncio.create_task(self._keep_members(), name="rota-etcd-members"))
        self._tasks += [asyncio.create_task(self._lead(sh), name=f"rota-etcd-shard-{sh.index}") for sh in self.shards]
        self._tasks.append(asyncio.create_task(self._keep_health(), name="rota-etcd-health"))

    async def stop(self) -> None:
        self.stopped.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for sh in self.shards:
            orch, term = sh.orch, sh.term
            if orch is not None and term is not None:
                await self._step_down(sh, orch, term, "replica stopping")
                await sh.election.resign(term)
        if self._member_lease and self.store.client is not None:
            with contextlib.suppress(Unavailable):
                await self.store.client.lease_revoke(self._member_lease)
        await self.store.close()

    def _over_share(self) -> bool:
        """True while this replica leads more than its share, ceil(shards / live replicas): only then
        does it hand shards over (so a replica's death moves its shards, not the survivors')."""
        return sum(sh.leading for sh in self.shards) > math.ceil(len(self.shards) / max(1, len(self.members)))

    def should_lead(self, shard: int) -> bool:
        """True when the balanced assignment over the live replicas gives ``shard`` to this one."""
        return len(self.shards) == 1 or assign(len(self.shards), self.members).get(shard) == self.id

    async def _lead(self, sh: _Shard) -> None:
        while not self.stopped.is_set():
            term = await sh.election.campaign(self.stopped, lambda: self.should_lead(sh.index))
            if term is None:
                return
            orch = EtcdOrchestrator(self.config, self.store.begin_term(term, self.config.ttl_s, sh.index),
                                      name=f"etcd leader {self.address}")
            orch.report_metrics_to(self.metrics)  # the replica's /metrics, fed by whichever term leads
            try:
                await orch.start()
            except RotaError as exc:
                log.error("replica %s won term %d of shard %d but could not load state: %s", self.address,
                          term.revision, sh.index, exc)
                await self._step_down(sh, orch, term, str(exc))
                continue
            sh.orch, sh.term = orch, term
            await self._publish_health()
            log.info("replica %s serves as leader of shard %d (term %d, %d groups)", self.address, sh.index,
                     term.revision, len(orch.groups))
            why = await self._watch_term(sh, term)
            await self._step_down(sh, orch, term, why)
            if why.startswith("handed over"):
                await sh.election.resign(term)

    async def _watch_term(self, sh: _Shard, term: Term) -> str:
        """Return why the term ended (lease lost or not refreshed in time, commit refused, handed over, stop)."""
        while not self.stopped.is_set():
            if term.lost.is_set():
                return term.why
            if not sh.election.still_valid(term):
                term.end("the leader lease could not be refreshed in time (etcd unreachable?)")
                return term.why
            if not self.should_lead(sh.index) and self._over_share():
                return f"handed over to replica {assign(len(self.shards), self.members).get(sh.index)}"
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(term.lost.wait(), 0.1)
        return "replica stopping"

    async def _step_down(self, sh: _Shard, orch: EtcdOrchestrator, term: Term, why: str) -> None:
        if sh.orch is orch:
            sh.orch = None
            await self._publish_health()
            log.warning("replica %s stops leading shard %d (term %d): %s", self.address, sh.index, term.revision, why)
        term.end(why)
        if self.store.keeper is not None:
            self.store.keeper.drop(term.lease)
        orch.close_sessions()  # tenants re-attach to the next leader
        with contextlib.suppress(Exception):
            await orch.stop()

    # ------------------------------------------------------ live replicas

    async def _refresh_members(self) -> None:
        """Register this replica (on a lease of its own) and re-read the live ones."""
        client = self.store.client or await self.store.connect()
        keeper = self.store.keeper
        assert keeper is not None
        if not self._member_lease or self._member_lease not in keeper.kept():
            lease, granted = await client.lease_grant(max(2, round(self.store.leader_ttl)))
            await client.put(self.store.replicas_prefix + self.id.encode(), json.dumps(self.identity).encode(),
                             lease=lease)
            keeper.keep(lease, granted, None)
            self._member_lease = lease
        reply = await client.get(self.store.replicas_prefix, prefix=True)
        ids = sorted(kv.key.decode().rsplit("/", 1)[1] for kv in reply.kvs)
        self.members = ids if self.id in ids else sorted([*ids, self.id])

    async def _keep_members(self) -> None:
        while not self.stopped.is_set():
            await asyncio.sleep(self.MEMBER_POLL_S)
            try:
                await self._refresh_members()
            except Unavailable as exc:
                log.warning("replica %s cannot list the live replicas: %s", self.address, exc)

    @property
    def leading(self) -> bool:
        """True while this replica grants turns (it leads at least one shard)."""
        return any(sh.leading for sh in self.shards)

    def health_states(self) -> tuple[bool, bool]:
        """(ready, leading): ready while calls here are answered — by this replica as leader, or
        redirected to a leader this follower knows (none is known while etcd is unreachable or
        during an election)."""
        if self.leading:
            return True, True
        known = [(sh.election.leader or {}).get("address", "") for sh in self.shards]
        return all(a and a != self.address for a in known), False

    async def _publish_health(self) -> None:
        """grpc.health.v1: the orchestrator services SERVING while ready, ``rota.leader`` while
        leading; the process itself ("") stays SERVING (liveness)."""
        states = self.health_states()
        if self.health is None or states == self._published:
            return
        from grpc_health.v1 import health_pb2

        from rota.orchestrator import LEADER_HEALTH, SERVICE_NAMES

        def status(on: bool) -> int:
            return health_pb2.HealthCheckResponse.SERVING if on else health_pb2.HealthCheckResponse.NOT_SERVING

        ready, leading = states
        for name in SERVICE_NAMES:
            await self.health.set(name, status(ready))
        await self.health.set(LEADER_HEALTH, status(leading))
        if self._published is not None and ready != self._published[0]:
            log.info("replica %s is %s", self.address, "ready" if ready else "not ready (no leader known)")
        self._published = states

    async def _keep_health(self) -> None:
        """Follow the election's view of the leader (it changes outside this replica's terms)."""
        while not self.stopped.is_set():
            await self._publish_health()
            await asyncio.sleep(0.2)

    # --------------------------------------------------- the orchestrator's API

    def _leading(self, job_id: str = "", group_id: str = "") -> EtcdOrchestrator:
        sh = self.shards[self.store.shard_of(group_id)]
        orch = sh.orch
        if orch is not None and sh.leading:
            return orch
        leader = (sh.election.leader or {}).get("address", "")
        if leader == self.address:
            leader = ""  # our own stale record: no leader known right now
        where = f"the leader is at {leader}" if leader else "no leader is elected yet"
        if len(self.shards) > 1:
            where = f"{where} for shard {sh.index} of group {group_id!r}"
        raise NotLeader(f"orchestrator {self.address} does not lead ({where}); retry there "
                        f"(job={job_id!r}, group={group_id!r}). rota clients follow the leader by themselves",
                        leader=leader, job_id=job_id, group_id=group_id)

    def _led(self, group_id: str) -> EtcdOrchestrator | None:
        sh = self.shards[self.store.shard_of(group_id)]
        return sh.orch if sh.leading else None

    async def acquire(self, req: TurnRequest) -> Grant:
        check_pair(req.job_id, req.group_id)
        with _naming(req.job_id, req.group_id):
            return await self._leading(req.job_id, req.group_id).acquire(req)

    async def release(self, job_id: str, group_id: str, token: int = 0, rank: int = 0, *,
                      footprint_bytes: int = 0, restore_seconds: float = 0.0) -> ReleaseInfo:
        check_pair(job_id, group_id)
        with _naming(job_id, group_id):
            return await self._leading(job_id, group_id).release(job_id, group_id, token, rank,
                                                                 footprint_bytes=footprint_bytes,
                                                                 restore_seconds=restore_seconds)

    async def abandon(self, job_id: str, group_id: str, token: int) -> None:
        orch = self._led(group_id)
        if orch is not None:
            await orch.abandon(job_id, group_id, token)

    async def evict(self, job_id: str, group_id: str, *, reason: str, lost: bool = False) -> tuple[bool, bool]:
        check_pair(job_id, group_id)
        with _naming(job_id, group_id):
            return await self._leading(job_id, group_id).evict(job_id, group_id, reason=reason, lost=lost)

    async def status(self, group_id: str = "") -> list[GroupState]:
        orch = self._led(group_id) if group_id else self.shards[0].orch if len(self.shards) == 1 else None
        if orch is not None:
            return await orch.status(group_id)
        return await self.store.status(group_id)  # what the leaders committed

    async def agent_job_states(self, group_id: str) -> list[tuple[str, str, str]]:
        """Node agents' view of the group's jobs (the group's leader asks them; followers know none)."""
        orch = self._led(group_id)
        return await orch.agent_job_states(group_id) if orch is not None else []

    async def attach(self, job_id: str, group_id: str, rank: int, pid: int, footprint_bytes: int, *,
                     can_prefetch: bool = False, world_size: int = 1, resume: str = "") -> Session:
        check_pair(job_id, group_id)
        orch = self._leading(job_id, group_id)
        s = await orch.attach(job_id, group_id, rank, pid, footprint_bytes, can_prefetch=can_prefetch,
                                world_size=world_size, resume=resume)
        self._owner[s] = orch
        log.debug("session of job %s rank %d (pid %d) attached to group %s", job_id, rank, pid, group_id)
        return s

    def _current(self, orch: EtcdOrchestrator | None) -> bool:
        return orch is not None and any(sh.orch is orch for sh in self.shards)

    def heartbeat(self, s: Session, footprint_bytes: int, memory: tuple[int, int, int] | None = None) -> None:
        orch = self._owner.get(s)
        if orch is not None and self._current(orch):
            orch.heartbeat(s, footprint_bytes, memory)

    def command_result(self, command_id: str, ok: bool, error: str, nbytes: int, seconds: float) -> None:
        for sh in self.shards:
            if sh.orch is not None:
                sh.orch.command_result(command_id, ok, error, nbytes, seconds)

    async def fault_rank(self, s: Session, reason: str) -> None:
        orch = self._owner.get(s)
        if orch is not None and self._current(orch):
            await orch.fault_rank(s, reason)

    async def detach(self, s: Session, why: str, *, clean: bool = False) -> None:
        orch = self._owner.pop(s, None)
        log.debug("session of job %s rank %d in group %s ended (%s)", s.job_id, s.rank, s.group_id, why)
        if orch is not None and self._current(orch):
            await orch.detach(s, why, clean=clean)
        else:
            s.alive = False  # a session of an ended term: the next leader judges the job

@contextlib.contextmanager
def _naming(job_id: str, group_id: str) -> Iterator[None]:
    """UNAVAILABLE from the store (etcd) names the group; make it name the job too."""
    try:
        yield
    except Unavailable as exc:
        if exc.job_id or f"job={job_id!r}" in str(exc):
            raise
        raise Unavailable(f"{exc} (job={job_id!r}, group={group_id!r})", delay=exc.delay, job_id=job_id,
                        group_id=group_id) from None


__all__ = ["EtcdOrchestrator", "Replica", "advertised_address"]
