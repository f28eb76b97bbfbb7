"""The group state machine: one holder, a queue, residents, tokens — and nothing else.

Pure data and pure transitions, no I/O and no clocks of its own (every call takes
``now``), so the same rules serve the embedded orchestrator (state in memory) and
``rota_etcd`` (state loaded from etcd, transformed here, written back in one
transaction). The hypothesis test in ``tests/core/test_state_machine.py`` drives
it with random acquire/release/crash/timeout sequences.

Invariants, enforced here and nowhere else:
* at most one holder per group; a grant happens only when there is none;
* ``token`` only grows: each grant takes ``token + 1``;
* a job of several ranks is granted only once every rank has asked for the turn;
* a release must name the holder and, if it carries a token, the current one;
* a job that died is removed from holder, queue and residents, its state ``lost``;
  one that closed its session itself is removed the same way, its state ``ended``.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rota._types import Grant, ReleaseInfo, TurnRequest
from rota.errors import NotHolder, StaleToken

_SAMPLES = 512  # recent waits/parks kept per tenant for percentiles
GONE = ("lost", "ended")  # states of a job whose processes are gone: vanished, or closed their sessions
TENANT_STATES = ("holding", "waiting", "resident", "parked", "faulted", "lost", "ended", "idle")


@dataclass
class Waiter:
    """A job queued for a group."""

    job_id: str
    seq: int
    arrived: float
    priority: int = 0
    weight: float = 1.0
    world_size: int = 1
    footprint_bytes: int = 0
    ranks: list[int] = field(default_factory=list)  # ranks that asked for this turn (empty: state from before)
    devices: list[str] = field(default_factory=list)  # devices it may run on (a lane's waiter may move to another)
    quiet: bool = False  # its turn asks for no prefetch while held (any rank's request says so)

    @property
    def complete(self) -> bool:
        """Every rank of the job asked: only then may it be granted (a missing rank would leave the others
        holding the group while they wait for it in a collective)."""
        return not self.ranks or len(set(self.ranks)) >= self.world_size


@dataclass
class TenantRecord:
    """Per-job accounting within a group (survives the job's turns)."""

    job_id: str
    state: str = "idle"  # idle | waiting | holding | resident | parked | faulted | lost | ended
    priority: int = 0
    weight: float = 1.0
    world_size: int = 1
    footprint_bytes: int = 0
    turns: int = 0
    gpu_seconds: float = 0.0
    parked_bytes: int = 0
    host_bytes: int = 0  # host memory behind the parked state, summed over live ranks
    spilled_bytes: int = 0
    residue_bytes: int = 0  # device bytes the last park left behind
    fault: str = ""  # why the job is FAULTED; cleared by its next grant
    parks_failed: int = 0  # parks of this job that failed (its state stayed on the device), ever
    restores_failed: int = 0  # restores by an agent and prefetches that failed (its state stayed parked), ever
    attached: bool = False  # speaks rota.v1 (had a session): must re-attach after a restart
    last_active: float = 0.0  # monotonic time of its last enqueue, grant, release or removal (for collection)
    waits_ms: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))
    parks_ms: deque = field(default_factory=lambda: deque(maxlen=_SAMPLES))


@dataclass
class GroupState:
    """Everything known about one group."""

    group_id: str
    created: float = 0.0
    token: int = 0
    holder: str = ""
    holder_since: float = 0.0
    holder_quiet: bool = False  # the holder's turn asked for no prefetch (TurnRequest.quiet)
    released_ranks: set[int] = field(default_factory=set)
    queue: list[Waiter] = field(default_factory=list)
    residents: list[str] = field(default_factory=list)
    loaded_job: str = ""
    switching_to: str = ""
    seq: int = 0
    switches: int = 0
    busy_seconds: float = 0.0
    prefetched: list[str] = field(default_factory=list)  # restored ahead of their grant, not yet granted
    prefetch_hits: int = 0  # grants that found the job already restored by a prefetch
    prefetch_misses: int = 0  # grants that still had to restore a parked job
    prefetch_failures: int = 0  # prefetches whose restore failed (the job stayed parked, or was FAULTED)
    prefetch_wasted: int = 0  # prefetched jobs parked again before their grant
    tenants: dict[str, TenantRecord] = field(default_factory=dict)

    # ------------------------------------------------------------- queries

    def queued(self, job_id: str) -> Waiter | None:
        return next((w for w in self.queue if w.job_id == job_id), None)

    def tenant(self, job_id: str) -> TenantRecord:
        rec = self.tenants.get(job_id)
        if rec is None:
            rec = self.tenants[job_id] = TenantRecord(job_id)
        return rec

    def current_grant(self) -> Grant:
        return Grant(job_id=self.holder, group_id=self.group_id, token=self.token)

    def status_name(self) -> str:
        """The v1alpha1 GroupStatus.State name for this group (the wire's; :meth:`state` is the plain one)."""
        if self.switching_to:
            return "SWITCHING"
        if self.holder:
            return "LOCKED"
        return "IDLE_YIELDED" if self.residents else "IDLE"

    def state(self) -> str:
        """What ``rota status`` shows: held, switching, idle-resident (jobs on the device, none holding), idle."""
        return {"SWITCHING": "switching", "LOCKED": "held", "IDLE_YIELDED": "idle-resident",
                "IDLE": "idle"}[self.status_name()]

    # ---------------------------------------------------------- transitions

    def enqueue(self, req: TurnRequest, now: float) -> Grant | None:
        """Queue ``req.job_id`` (once per job, whatever its ranks). Returns the
        current grant at once if the job already holds the group and this rank has
        not yet released this turn; a rank that already released queues the job for
        its next turn, so all ranks always hold the same turn."""
        if self.holder == req.job_id and req.rank not in self.released_ranks:
            return self.current_grant()
        rec = self.tenant(req.job_id)
        rec.last_active = now
        rec.priority, rec.weight = req.priority, req.weight
        rec.world_size = max(1, req.world_size)
        if req.footprint_bytes:
            rec.footprint_bytes = req.footprint_bytes
        waiter = self.queued(req.job_id)
        if waiter is None:
            self.seq += 1
            waiter = Waiter(req.job_id, self.seq, now, req.priority, req.weight, rec.world_size, req.footprint_bytes)
            self.queue.append(waiter)
            if rec.state not in ("resident", "parked", "holding"):
                rec.state = "waiting"
        waiter.world_size = rec.world_size
        waiter.devices = list(req.devices)
        waiter.quiet = waiter.quiet or req.quiet
        if req.rank not in waiter.ranks:
            waiter.ranks.append(req.rank)
        return None

    def grantable(self) -> list[Waiter]:
        """Waiters whose every rank has asked (what a policy may choose from)."""
        return [w for w in self.queue if w.complete]

    def prefetch_plan(self, job_id: str, capacity_bytes: int) -> list[str] | None:
        """Idle residents to park so that parked ``job_id`` fits now; None if it cannot be prefetched.

        Only with everything known: a device size, the job's footprint and every
        resident's footprint (a resident reporting 0 might hold anything). Residents are
        parked in :meth:`park_order`, as a switch would, but never the holder and never a job that
        waits for a turn itself: those keep their place, and if the job does not fit
        beside them it is not prefetched. An empty list means it fits as things are.
        """
        rec = self.tenants.get(job_id)
        if capacity_bytes <= 0 or rec is None or rec.state != "parked" or rec.footprint_bytes <= 0:
            return None
        if job_id in self.residents or self.switching_to or self.queued(job_id) is None:
            return None
        held = {j: self.tenant(j).footprint_bytes for j in self.residents}
        if not all(n > 0 for n in held.values()):
            return None
        total = rec.footprint_bytes + sum(held.values()) + self.residue_off(job_id)
        evict: list[str] = []
        for job in self.park_order():
            if total <= capacity_bytes:
                break
            if job != self.holder and self.queued(job) is None:
                evict.append(job)
                total -= held[job]
        return evict if total <= capacity_bytes else None

    def park_order(self) -> list[str]:
        """Residents in the order they are parked to make room: lowest priority first, then oldest first.

        So a high-priority job that needs room displaces low-priority residents, not its peers.
        """
        return sorted(self.residents, key=lambda job: self.tenant(job).priority)

    def residue_off(self, incoming: str) -> int:
        """Device bytes that live, non-resident tenants left behind at their last park (not ``incoming``'s).

        Parking cannot free them, so they count against the device beside the residents:
        a leak in a parked tenant makes the switch park more, instead of the incoming
        tenant's restore running out of room.
        """
        return sum(rec.residue_bytes for job, rec in self.tenants.items()
                   if job != incoming and job not in self.residents and rec.state not in GONE)

    def mark_prefetched(self, job_id: str) -> None:
        """A prefetch restored ``job_id`` ahead of its grant: it occupies the device now."""
        if job_id not in self.residents:
            self.residents.append(job_id)
        if job_id not in self.prefetched:
            self.prefetched.append(job_id)
        self.tenant(job_id).state = "resident"

    def ready_for_grant(self) -> bool:
        return not self.holder and not self.switching_to and any(w.complete for w in self.queue)

    def begin_switch(self, chosen: Waiter, capacity_bytes: int,
                     choose: Callable[[dict[str, int], int, int], list[str] | None] | None = None) -> list[str]:
        """Start handing the group to ``chosen``; return residents that must be parked.

        With ``capacity_bytes`` > 0, residents that fit beside ``chosen`` stay
        (residency-aware switching); otherwise every other resident with a known
        footprint is parked. Residents whose footprint is 0 hold nothing to park.
        ``choose(residents, need, residue)`` (a lane of a multi-device group: the cheapest
        set by :func:`rota.placement.evict_plan`) picks them instead of :meth:`park_order`.
        """
        assert self.ready_for_grant() and chosen in self.queue
        self.switching_to = chosen.job_id
        others = [j for j in self.park_order() if j != chosen.job_id]
        need = self.tenant(chosen.job_id).footprint_bytes
        evict: list[str] = []
        if choose is not None:
            picked = choose({j: self.tenant(j).footprint_bytes for j in others}, need,
                            self.residue_off(chosen.job_id))
            return list(others) if picked is None else picked  # nothing frees enough: park them all
        if capacity_bytes > 0:
            total = need + sum(self.tenant(j).footprint_bytes for j in others) + self.residue_off(chosen.job_id)
            for job in others:  # park residents in park order until everything fits
                if total <= capacity_bytes:
                    break
                evict.append(job)
                total -= self.tenant(job).footprint_bytes
        else:
            evict = [j for j in others if self.tenant(j).footprint_bytes > 0]
        return evict

    def mark_parked(self, job_id: str, bytes_moved: int, seconds: float) -> None:
        """A resident's park finished: it no longer occupies the device."""
        if job_id in self.residents:
            self.residents.remove(job_id)
        if job_id in self.prefetched:  # restored early, parked again before its turn came
            self.prefetched.remove(job_id)
            self.prefetch_wasted += 1
        rec = self.tenant(job_id)
        if rec.state not in GONE:
            rec.state = "parked"
        rec.parked_bytes = bytes_moved
        rec.parks_ms.append(seconds * 1000.0)

    def complete_grant(self, now: float, *, prefetch: bool = False) -> Grant:
        """Finish the switch begun by :meth:`begin_switch`: the chosen job holds the group.

        With ``prefetch`` (the orchestrator prefetches), count whether the grant found
        the job restored ahead of time (a hit) or still had to restore it (a miss).
        """
        job = self.switching_to
        waiter = self.queued(job)
        assert job and waiter is not None and not self.holder
        self.queue.remove(waiter)
        self.switching_to = ""
        rec = self.tenant(job)
        restored = rec.state == "parked"
        if job in self.prefetched:
            self.prefetched.remove(job)
            self.prefetch_hits += 1
        elif restored and prefetch:
            self.prefetch_misses += 1
        if self.loaded_job and self.loaded_job != job:
            self.switches += 1
        self.token += 1
        self.holder, self.holder_since, self.holder_quiet = job, now, waiter.quiet
        self.released_ranks = set()
        if job not in self.residents:
            self.residents.append(job)
        self.loaded_job = job
        rec.state, rec.turns, rec.fault = "holding", rec.turns + 1, ""
        rec.world_size = waiter.world_size
        waited_ms = max(0, int((now - waiter.arrived) * 1000))
        rec.waits_ms.append(float(waited_ms))
        return Grant(job, self.group_id, self.token, waited_ms=waited_ms, context_restored=restored)

    def abort_switch(self) -> None:
        """The switch could not finish (the chosen job vanished): back to idle."""
        self.switching_to = ""

    def release(self, job_id: str, token: int, rank: int, now: float) -> ReleaseInfo:
        """One rank of the holder gives the turn back; the last rank frees the group."""
        if self.holder != job_id:  # who does hold it is another job's business: not said
            raise NotHolder(f"job {job_id!r} does not hold group {self.group_id!r}; acquire before releasing",
                            job_id=job_id, group_id=self.group_id)
        if token and token != self.token:  # the current token is not said either: it would let anyone release
            raise StaleToken(f"job {job_id!r} released group {self.group_id!r} with token {token}, which is not "
                             "its current grant's; that turn already ended", job_id=job_id, group_id=self.group_id)
        rec = self.tenant(job_id)
        rec.last_active = now
        self.released_ranks.add(rank)
        if len(self.released_ranks) < rec.world_size:
            return ReleaseInfo(len(self.queue), not self.queue, group_released=False)
        self._end_turn(now)
        rec.state = "resident"
        return ReleaseInfo(len(self.queue), not self.queue, group_released=True)

    def _end_turn(self, now: float) -> None:
        held = max(0.0, now - self.holder_since)
        self.busy_seconds += held
        self.tenant(self.holder).gpu_seconds += held
        self.holder, self.released_ranks, self.holder_quiet = "", set(), False

    def remove(self, job_id: str, now: float, *, lost: bool, ended: bool = False) -> tuple[bool, bool]:
        """Take a job out entirely (it died, closed its session, or a scheduler evicted it).

        Returns (was_holder, was_queued). A job that vanished without closing is ``lost``,
        one that closed its last session is ``ended`` (a FAULT it had stays shown): neither
        is ever restored or handed anything, and a later removal (the scheduler's eviction
        of the finished job) keeps that state. Otherwise it is ``idle``.
        """
        was_holder = self.holder == job_id
        if was_holder:
            self._end_turn(now)
        waiter = self.queued(job_id)
        if waiter is not None:
            self.queue.remove(waiter)
        if self.switching_to == job_id:
            self.switching_to = ""
        if job_id in self.residents:
            self.residents.remove(job_id)
        if job_id in self.prefetched:
            self.prefetched.remove(job_id)
        if self.loaded_job == job_id:
            self.loaded_job = ""
        rec = self.tenants.get(job_id)
        if rec is not None:
            if rec.state in GONE:
                pass  # the first verdict stands: a scheduler's eviction after the job ended changes nothing
            elif lost:
                rec.state = "lost"
            elif not (ended and rec.state == "faulted"):
                rec.state = "ended" if ended else "idle"
            rec.last_active = now
        return was_holder, waiter is not None

    def idle_since(self) -> float | None:
        """When this group last saw activity, if nobody holds it or waits for it now (else None).

        Residents do not count here: the orchestrator forgets a group only when none of its
        jobs has a live session, and a resident without one holds nothing rota parks.
        """
        if self.holder or self.queue or self.switching_to:
            return None
        return max([self.created, *(rec.last_active for rec in self.tenants.values())])

    def collect(self, now: float, ttl_s: float, keep: set[str]) -> list[str]:
        """Forget tenants that ended (idle, ended, lost or faulted and not in ``keep``) more than ``ttl_s`` ago."""
        gone = [job for job, rec in self.tenants.items()
                if job not in keep and rec.state in ("idle", "faulted", *GONE) and now - rec.last_active > ttl_s
                and job not in self.residents and self.queued(job) is None and job != self.holder]
        for job in gone:
            del self.tenants[job]
        return gone

    # -------------------------------------------------------- serialisation

    def to_dict(self) -> dict[str, Any]:
        """Plain-JSON form (for etcd and ``rota status --json``)."""
        d = dataclasses.asdict(self)
        d["released_ranks"] = sorted(self.released_ranks)
        for rec in d["tenants"].values():
            rec["waits_ms"], rec["parks_ms"] = list(rec["waits_ms"]), list(rec["parks_ms"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupState:
        d = dict(d)
        d["released_ranks"] = set(d.get("released_ranks", ()))
        d["queue"] = [Waiter(**w) for w in d.get("queue", ())]
        tenants = {}
        for job, rec in d.get("tenants", {}).items():
            rec = dict(rec)
            rec["waits_ms"] = deque(rec.get("waits_ms", ()), maxlen=_SAMPLES)
            rec["parks_ms"] = deque(rec.get("parks_ms", ()), maxlen=_SAMPLES)
            tenants[job] = TenantRecord(**rec)
        d["tenants"] = tenants
        return cls(**d)
