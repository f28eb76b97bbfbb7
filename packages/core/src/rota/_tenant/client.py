"""The tenant-side client: ``rota.connect()`` returns a :class:`Gpu`.

A :class:`Gpu` is one rank of one job in one group. It acquires and releases turns
through the plugin hooks (the built-in :mod:`rota._tenant.lease` speaks gRPC to the
orchestrator), keeps a session open so the orchestrator sees it alive, and runs the
snapshot hooks: restore when a turn starts after a park, park when the
orchestrator asks (only ever between turns).

Environment (each value is checked; a bad one raises :class:`rota.errors.ConfigError`):
    ROTA_GROUP         group to share (default ``default``)
    ROTA_TENANT        job id, the same on every rank (default ``<host>-<pid>``)
    ROTA_ORCHESTRATOR  ``host:port`` or ``unix:PATH`` (comma-separated replicas allowed);
                       unset = start or find the embedded orchestrator on this host
    ROTA_WORLD_SIZE, ROTA_RANK   ranks of a multi-process job (under torchrun its RANK and
                       WORLD_SIZE win; without either, torch.distributed's)
    ROTA_PRIORITY      integer, higher first under the priority policy (default 0)
    ROTA_WEIGHT        positive share under the fair-share policy (default 1)
    ROTA_HEARTBEAT_S   seconds between heartbeats (default 1)
    ROTA_CONNECT_TIMEOUT_S   seconds the first turn waits for the orchestrator before it fails
                       with the address and where it came from (default 30)
    ROTA_TOKEN         bearer token for an orchestrator that checks credentials (rota.auth)
    ROTA_TLS_CA, ROTA_TLS_CERT, ROTA_TLS_KEY   TLS to the orchestrator (CA; client cert for mTLS)
    ROTA_RESIDUE_MAX_BYTES   device bytes a park may leave behind before it is a fault
                       (default 256 MiB; see :func:`rota.residue.residue_fault`)
    ROTA_DEVICES       devices of this host the job may run on (``0,1``, ``cuda:0,cuda:1``, or ``all``:
                       every device CUDA_VISIBLE_DEVICES lists, as Slurm's GRES and a Kubernetes
                       claim set it); each turn is placed on one of them and :attr:`Gpu.device` names
                       it (see :mod:`rota.devices`). Unset: the group's one device, as before.

Several devices: a turn may be granted on another device than the one the job's state
is on. The restore hooks then get ``ParkPlan.device``: a parked state is restored there,
a resident one moves there device to device (rota_torch: a peer copy), before the turn.

Switch guarantees on this side: a park whose adapters report more residue than
``ROTA_RESIDUE_MAX_BYTES`` is reported to the orchestrator as failed, naming what
stayed, so the job is FAULTED (its state stays parked and is restored at its next
turn) and the next tenant still runs. A restore that fails (refused verification, no
room, deadline) releases the turn it was granted and raises; the state stays parked.
A restore the orchestrator asks for ahead of the grant (prefetch, a ``restore``
session command) runs the same code in a background thread; if it fails the state
stays parked and the grant restores it as usual.

A job of several ranks is one unit: when one rank's restore fails or its turn raises,
it reports a :meth:`Gpu.fault` and the orchestrator FAULTs the whole job and ends its
turn; when a rank's process dies, its session breaks and the same happens. The other
ranks are sent ``abort``: the ``rota_job_aborted`` hook aborts their collectives (the
built-in :mod:`rota._tenant.collectives` aborts ``torch.distributed``), and their client refuses
further turns until the job is restarted.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import queue
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import pluggy

from rota._ids import check_id
from rota._plugins import plugin_manager
from rota._tenant.link import OrchestratorLink
from rota._tenant.session import MemoryReports, SessionStream
from rota._types import Grant, ParkPlan, ParkResult, ReleaseInfo, ReleaseRequest, TurnRequest
from rota.config import check_endpoint, env_float, env_int
from rota.devices import env_devices, parse_devices
from rota.errors import (
    ConfigError,
    InvalidArgument,
    RotaError,
    TransientError,
    Unavailable,
)
from rota.residue import ResidueError, residue_fault, residue_max_bytes

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 30.0  # default ROTA_CONNECT_TIMEOUT_S: how long a first acquire waits for the orchestrator


STATS_KEEP = 10_000  # entries each TurnStats record keeps: a long-running tenant must not grow without bound


class Recent(deque):  # type: ignore[type-arg]
    """The latest :data:`STATS_KEEP` entries, plus how many were ever appended.

    Readers that take only what is new keep the running :attr:`total` they saw last and call :meth:`since`.
    """

    def __init__(self) -> None:
        super().__init__(maxlen=STATS_KEEP)
        self.total = 0
        self._lock = threading.Lock()  # appends come from the turn and park threads

    def append(self, item: object) -> None:
        with self._lock:
            super().append(item)
            self.total += 1

    def since(self, total: int) -> tuple[list, int]:  # type: ignore[type-arg]
        """Entries appended after the running total was ``total`` (those still kept, oldest first), and the
        running total now (pass it to the next call)."""
        with self._lock:
            new = min(self.total - total, len(self))
            return (list(itertools.islice(reversed(self), new))[::-1] if new > 0 else []), self.total


@dataclass
class TurnStats:
    """What this client saw: per-turn waits and the cost of its parks and restores (the latest entries)."""

    turns: int = 0
    waits_ms: Recent = field(default_factory=Recent)  # of float
    parks: Recent = field(default_factory=Recent)  # of ParkResult
    restores: Recent = field(default_factory=Recent)  # of ParkResult
    moves: Recent = field(default_factory=Recent)  # of ParkResult: resident state moved to the turn's device
    events: Recent = field(default_factory=Recent)  # of (kind, start, end), monotonic
    #: parks and restores that failed: (kind "park" | "restore", monotonic time, "Type: message"). A failed park
    #: left the state on the device; a failed restore left it parked. Never empty after a failure: results count it.
    failures: Recent = field(default_factory=Recent)

    def failed(self, kind: str) -> int:
        """How many parks (``"park"``) or restores (``"restore"``) failed, of all this client saw."""
        return sum(1 for k, _, _ in list(self.failures) if k == kind)


class Gpu(SessionStream):
    """One rank of a job sharing a group of devices. Create it with :func:`rota.connect`."""

    def __init__(self, group: str, tenant: str, endpoint: str, *, rank: int = 0, world_size: int = 1,
                 priority: int = 0, weight: float = 1.0, heartbeat_s: float = 1.0,
                 pm: pluggy.PluginManager | None = None, footprint_hint: int = 0, token: str | None = None,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S, endpoint_source: str = "endpoint",
                 devices: tuple[str, ...] | list[str] | str | None = None) -> None:
        self.group = check_id("group", group, job_id=tenant, group_id=group)
        self.tenant = check_id("tenant", tenant, job_id=tenant, group_id=group)
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is outside world size {world_size} (job={tenant!r}, group={group!r})")
        self.devices = parse_devices(devices, "devices")
        if self.devices and world_size > 1:
            raise ConfigError(f"devices={','.join(self.devices)} given to rank {rank} of a job of {world_size} ranks; "
                              "a multi-rank job keeps its devices (its collectives are bound to them): unset "
                              "ROTA_DEVICES for it and let the launcher pick each rank's device")
        # where this job's state lives (or will be built): the first named device until a grant says otherwise
        self._state_device = self.devices[0] if self.devices else ""
        self.endpoint, self.rank, self.world_size = endpoint, rank, world_size
        self.connect_timeout_s, self.endpoint_source = connect_timeout_s, endpoint_source
        self._session_error: RotaError | None = None  # why the session last failed (for a clear acquire error)
        self.priority, self.weight, self.heartbeat_s = priority, weight, heartbeat_s
        if footprint_hint < 0:
            raise ConfigError(f"footprint_hint={footprint_hint!r} must be >= 0 bytes (0 = none)")
        # Device bytes this tenant is about to need, reported until its adapters track something: the first
        # turn of a job that builds a big model then makes room for it instead of running out of memory.
        self.footprint_hint = footprint_hint
        self.pm = pm or plugin_manager()
        self.grant: Grant | None = None
        self.stats = TurnStats()
        self.parked = False
        self.aborted = ""  # why the orchestrator aborted this job (another rank died or faulted)
        self.last_park = ParkResult()
        self.park_failed = False  # the last park raised: its state stayed on the device (heartbeats count it)
        self._resume = ""  # our live session's secret (rota.v1 TenantCommand.resume): a reconnect takes it over
        self._yield_requested = threading.Event()
        self._state_lock = threading.Lock()  # serialises park, restore and turn start
        self._turn_started = 0.0
        self.turn_restore_s = 0.0  # this rank's restore at the current turn's start (0: none)
        from rota import auth

        # the channel to the orchestrator (the token proves this tenant may act for its job), which the
        # session and the lease hooks share
        self.link = OrchestratorLink(endpoint, auth.env_token() if token is None else token, name=tenant)
        self._outbox: queue.Queue = queue.Queue()
        self._reports = MemoryReports()  # what the session last told the orchestrator of this rank's memory
        self._closed = threading.Event()
        self._attached = threading.Event()  # set once the orchestrator has registered our session
        self._session = threading.Thread(target=self._run_session, name=f"rota-session-{tenant}", daemon=True)
        self._session.start()
        atexit.register(self.close)

    # ------------------------------------------------------------------ turns

    def acquire(self, *, quiet: bool = False) -> Grant:
        """Block until this job holds the group; restore parked state; return the grant.

        ``quiet``: see :meth:`turn`. A turn this rank already holds is returned as it is.
        """
        if not isinstance(quiet, bool):
            raise InvalidArgument(f"quiet={quiet!r} must be True or False (quiet=True: the orchestrator "
                                  "prefetches nothing while this turn is held)", job_id=self.tenant,
                                  group_id=self.group)
        if self.aborted:
            raise self._aborted_error()
        if self.grant is not None:
            return self.grant
        req = TurnRequest(self.tenant, self.group, self.priority, self.weight, self.world_size, self.rank,
                          self.footprint_bytes(), self.devices, quiet)
        self._wait_attached()  # else the orchestrator could not park us later
        t0 = time.monotonic()
        waiting = threading.Timer(1.0, log.info, ("job %s rank %d: waiting for a turn in group %s", self.tenant,
                                                  self.rank, self.group))
        waiting.daemon = True
        waiting.start()
        try:
            grant = self.pm.hook.rota_acquire(request=req, link=self.link)
        finally:
            waiting.cancel()
        t1 = time.monotonic()
        if t1 - t0 >= 1.0:
            log.info("job %s rank %d: got its turn in group %s after %.1f s", self.tenant, self.rank, self.group,
                     t1 - t0)
        self.stats.events.append(("wait", t0, t1))
        with self._state_lock:
            self.turn_restore_s = 0.0
            if self.parked or self._moves(grant.device):  # not restored ahead of the grant (by a prefetch),
                # or granted on another device than its state's: restore (or move) now
                try:
                    self._restore_locked(ParkPlan(token=grant.token, device=grant.device))
                    self.turn_restore_s = time.monotonic() - t1  # reported with the release (restore histogram)
                except Exception as exc:  # rolled back by the adapter: give the turn back, stay parked
                    log.error("restore of job %s rank %d in group %s failed: %s; releasing the turn (state stays "
                              "parked; acquire again to retry)", self.tenant, self.rank, self.group, exc)
                    if self.world_size > 1:  # the other ranks are restored and would wait for this one
                        self.fault(f"restore failed: {type(exc).__name__}: {exc}")
                    with contextlib.suppress(RotaError, grpc.RpcError):
                        self.pm.hook.rota_release(request=self._release_request(grant), link=self.link)
                    if isinstance(exc, RotaError):
                        exc.job_id, exc.group_id = exc.job_id or self.tenant, exc.group_id or self.group
                    raise
            self.grant = grant
            self._yield_requested.clear()
            self._turn_started = time.monotonic()
        self.stats.turns += 1
        self.stats.waits_ms.append(grant.waited_ms)
        self.pm.hook.rota_turn_started(tenant=self, grant=grant)
        return grant

    def _moves(self, device: str) -> bool:
        """A turn on ``device`` needs this job's resident state moved there first."""
        return bool(device and self._state_device and device != self._state_device)

    @property
    def device(self) -> str | None:
        """The device of this job's turn (``cuda:1``): where its state is, or is being built; None
        when no devices were named (the group's one device: the process's own default).

        In a turn it is the granted device; between turns, the device of the last turn.
        """
        if self.grant is not None and self.grant.device:
            return self.grant.device
        return self._state_device or None

    def _wait_attached(self) -> None:
        """Wait for the session to be registered; a refusal or silence past the connect timeout is an error
        naming the address and where it came from (an unreachable orchestrator must not hang a job)."""
        deadline = time.monotonic() + self.connect_timeout_s
        while not self._attached.wait(0.05):
            err = self._session_error
            where = f"{self.endpoint} (from {self.endpoint_source})"
            if err is not None and not isinstance(err, TransientError):
                raise type(err)(f"the orchestrator at {where} refused job {self.tenant!r}: {err}",
                                job_id=self.tenant, group_id=self.group)
            if time.monotonic() > deadline:
                cause = f": {err}" if err is not None else ""
                raise Unavailable(f"no orchestrator answered at {where} within {self.connect_timeout_s:g} s (set "
                                  f"ROTA_CONNECT_TIMEOUT_S to wait longer){cause}; check that it runs and that the "
                                  "address is right", job_id=self.tenant, group_id=self.group)

    def release(self) -> ReleaseInfo:
        """End this rank's turn. Returns at once; parking (if any) happens later."""
        if self.grant is None:
            raise InvalidArgument(f"job {self.tenant!r} rank {self.rank} does not hold group {self.group!r}; "
                                  "call acquire() first", job_id=self.tenant, group_id=self.group)
        grant, self.grant = self.grant, None
        if self.aborted:  # the orchestrator already ended this job's turn
            raise self._aborted_error()
        end = time.monotonic()
        self.stats.events.append(("turn", self._turn_started, end))
        info = self.pm.hook.rota_release(request=self._release_request(grant), link=self.link)
        self.pm.hook.rota_turn_ended(tenant=self, grant=grant, seconds=end - self._turn_started)
        return info

    @contextlib.contextmanager
    def turn(self, *, after: Callable[[], None] | None = None, quiet: bool = False) -> Iterator[Grant]:
        """``with gpu.turn():`` — hold the group for the block, release after it.

        ``quiet=True``: while this turn is held the orchestrator starts no prefetch in the
        group (it parks no idle resident and restores no waiter early), so rota moves no other
        tenant's device memory meanwhile. For starting an inference engine: vLLM's ``LLM(...)``
        profiles the device's free memory and fails if it changes. In a job of several ranks
        the turn is quiet if any rank asks.

        ``after``: run right after the release, with this tenant's state still on the
        device: no park (nor prefetch restore) of it starts until ``after`` returns. For
        copies *out of* device state that need no compute, such as pushing new weights
        to a sampler: the copy engine does them while the next tenant computes. ``after``
        must launch no kernels that compete with that tenant and must finish its copies
        (synchronise) before it returns.

        If the block raises in a job of several ranks, the job is FAULTED as a unit
        (:meth:`fault`): the other ranks would otherwise wait for this one in a collective.
        """
        grant = self.acquire(quiet=quiet)
        try:
            yield grant
        except BaseException as exc:
            if self.world_size > 1:
                self.fault(f"its turn raised {type(exc).__name__}: {exc}")
            with contextlib.suppress(RotaError, grpc.RpcError):
                self.release()
            raise
        if after is None:
            self.release()
            return
        with self._state_lock:  # a park command waits here until ``after`` is done
            self.release()
            t0 = time.monotonic()
            after()
            self.stats.events.append(("after", t0, time.monotonic()))

    @contextlib.contextmanager
    def hold_state(self) -> Iterator[None]:
        """Between turns, hold this rank's device state where it is: no park, restore or prefetch of it runs
        inside the block (the orchestrator's commands wait for it to end).

        For code that reads, changes or frees tracked tensors outside a turn: a checkpoint written from the
        device, or freeing the state at the end of a run before :meth:`close`. Keep it short: a park the
        orchestrator asked for waits meanwhile, and so does the tenant it makes room for.
        """
        if self.grant is not None:
            raise InvalidArgument(f"job {self.tenant!r} holds group {self.group!r}: inside a turn its state is "
                                  "already held; hold_state() is for code between turns",
                                  job_id=self.tenant, group_id=self.group)
        with self._state_lock:
            yield

    def fault(self, reason: str) -> None:
        """Report that this rank cannot go on: the orchestrator FAULTs the whole job and ends its turn.

        The other ranks of the job are sent ``abort`` (see the module docs). Returns at
        once; the report travels on this rank's session.
        """
        from rota._generated import rota_v1_pb2 as pb

        log.error("job %s rank %d in group %s: %s; reporting a fault of the job", self.tenant, self.rank,
                  self.group, reason)
        self._outbox.put(pb.TenantMessage(fault=pb.RankFault(reason=reason[:1000])))

    @property
    def should_yield(self) -> bool:
        """True when the policy asked this holder to release at its next step boundary."""
        return self._yield_requested.is_set()

    def footprint(self) -> dict[str, int]:
        """Device bytes per tag, summed over every adapter tracking this tenant."""
        total: dict[str, int] = {}
        for part in self.pm.hook.rota_footprint(tenant=self):
            for tag, n in (part or {}).items():
                total[tag] = total.get(tag, 0) + int(n)
        return total

    def footprint_bytes(self) -> int:
        """What the adapters track, or :attr:`footprint_hint` while they track nothing."""
        return sum(self.footprint().values()) or self.footprint_hint

    @property
    def stub(self) -> Any:
        """The ``rota.v1.RotaService`` stub on this tenant's link to its orchestrator (follows the leader)."""
        return self.link.stub

    def _release_request(self, grant: Grant) -> ReleaseRequest:
        """What ``rota_release`` needs to end ``grant``: this rank, its footprint, its restore at the turn's start."""
        return ReleaseRequest(grant, self.rank, self.safe_footprint(), self.turn_restore_s)

    def park(self, plan: ParkPlan | None = None) -> ParkResult:
        """Park this tenant's tracked state now (normally the orchestrator asks for it).

        Parking an already parked tenant moves nothing and returns :attr:`last_park`, whose
        residue is still on the device. A park over ``ROTA_RESIDUE_MAX_BYTES`` raises
        :class:`rota.residue.ResidueError` (the state is parked) carrying ``park_result``.
        """
        with self._state_lock:
            if self.parked:
                return self.last_park
            return self._park_locked(plan or ParkPlan())

    def recheck_park(self) -> str:
        """Measure again what the last park left on the device; the residue fault it still shows, or "".

        For a tenant whose park left too much (:class:`rota.residue.ResidueError`) and that freed what
        it could since: parked adapters move nothing and read the device again. The new reading
        replaces the last park's, so heartbeats tell the orchestrator what is really left.
        """
        with self._state_lock:
            if not self.parked or not self.stats.parks:
                return ""
            again = self._run_snapshot_hooks(self.pm.hook.rota_park, ParkPlan())
            self.stats.parks[-1].residue = self.last_park.residue = again.residue
            return residue_fault(self.last_park, residue_max_bytes())

    def restore(self, plan: ParkPlan | None = None) -> ParkResult:
        """Restore parked state now, between turns, as :meth:`acquire` would after its grant.

        For whoever restores ahead of the grant (the node agent, so the restore overlaps
        the previous holder's park). Nothing to do when not parked; refused mid-turn.
        """
        with self._state_lock:
            if self.parked and self.grant is not None:
                raise InvalidArgument(f"job {self.tenant!r} holds group {self.group!r}; nothing to restore mid-turn")
            return self._restore_locked(plan or ParkPlan())

    def close(self) -> None:
        """Leave: release a held turn, end the session (the orchestrator forgets this job)."""
        if self._closed.is_set():
            return
        if self.grant is not None:
            with contextlib.suppress(RotaError, grpc.RpcError):
                self.release()
        self._closed.set()
        self._outbox.put(None)
        self._session.join(timeout=5)
        self.link.close()

    def __enter__(self) -> Gpu:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Gpu(group={self.group!r}, tenant={self.tenant!r}, rank={self.rank}/{self.world_size})"

    # ------------------------------------------------------------- internals

    def _park_locked(self, plan: ParkPlan) -> ParkResult:
        if self.grant is not None:
            raise InvalidArgument(f"job {self.tenant!r} holds group {self.group!r}: a holder is never parked")
        if self.parked:
            return ParkResult()
        t0 = time.monotonic()
        try:
            result = self._run_snapshot_hooks(self.pm.hook.rota_park, plan)
        except Exception as exc:
            self.park_failed = True  # the adapters rolled back: the state is still on the device
            self.stats.failures.append(("park", t0, f"{type(exc).__name__}: {exc}"))
            raise
        self.park_failed = False
        self.stats.parks.append(result)
        self.stats.events.append(("park", t0, time.monotonic()))
        self.parked = True
        self.last_park = result
        fault = residue_fault(result, residue_max_bytes())
        if fault:
            self.stats.failures.append(("park", t0, f"ResidueError: {fault}"))
            log.error("job %s rank %d in group %s: %s", self.tenant, self.rank, self.group, fault)
            err = ResidueError(fault, job_id=self.tenant, group_id=self.group)
            err.park_result = result  # type: ignore[attr-defined]
            raise err
        return result

    def _restore_locked(self, plan: ParkPlan) -> ParkResult:
        """Run the restore hooks (caller holds ``_state_lock``): at a grant, or ahead of it
        when the orchestrator prefetches; with ``plan.device`` another device than its state's,
        a resident state moves there. On failure the adapters rolled back: still parked (or where it was)."""
        moving = not self.parked and self._moves(plan.device)
        if not self.parked and not moving:
            return ParkResult()
        t0 = time.monotonic()
        try:
            result = self._run_snapshot_hooks(self.pm.hook.rota_restore, plan)
        except Exception as exc:
            self.stats.failures.append(("restore", t0, f"{type(exc).__name__}: {exc}"))
            raise
        if not moving or result.bytes_moved or result.by_tag:  # a move of nothing built yet is no move
            (self.stats.moves if moving else self.stats.restores).append(result)
            self.stats.events.append(("move" if moving else "restore", t0, time.monotonic()))
        self.parked = False
        if plan.device:
            self._state_device = plan.device
        return result

    def _run_snapshot_hooks(self, hook: pluggy.HookCaller, plan: ParkPlan) -> ParkResult:
        t0 = time.perf_counter()
        total = ParkResult()
        for part in hook(tenant=self, plan=plan):
            if part is None:
                continue
            total.bytes_moved += part.bytes_moved
            for tag, n in part.by_tag.items():
                total.by_tag[tag] = total.by_tag.get(tag, 0) + n
            for key, n in part.residue.items():  # parts run one after another: a process-wide reading of a
                # later part is taken after the earlier parts freed their state, so the latest one is the truth
                total.residue[key] = n if key.startswith("process:") else total.residue.get(key, 0) + n
            total.discarded += [t for t in part.discarded if t not in total.discarded]
            total.recreated += [t for t in part.recreated if t not in total.recreated]
            total.host_bytes += part.host_bytes
            total.spilled_bytes += part.spilled_bytes
            total.verify_seconds += part.verify_seconds
        total.seconds = time.perf_counter() - t0
        return total

    def safe_footprint(self) -> int:
        try:
            return self.footprint_bytes()
        except Exception:  # an adapter mid-change must not kill the heartbeat
            return 0


def _ranks() -> tuple[int, int]:
    """(rank, world size): torchrun's, ROTA_RANK/ROTA_WORLD_SIZE, torch.distributed's, else (0, 1).

    Under torchrun (``TORCHELASTIC_RUN_ID`` set) its ``RANK``/``WORLD_SIZE`` win, even
    before ``init_process_group``: ``ROTA_*`` values there were inherited from the
    launcher (a Slurm task, a pod) and would give every worker the same rank.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID") and os.environ.get("WORLD_SIZE"):
        world = env_int("WORLD_SIZE", 1, minimum=1)
        rank = env_int("RANK", 0, minimum=0)
        if rank >= world:
            raise ConfigError(f"RANK={rank} must be below WORLD_SIZE={world} (set by torchrun)")
        return rank, world
    if os.environ.get("ROTA_RANK") and not os.environ.get("ROTA_WORLD_SIZE"):
        raise ConfigError(f"ROTA_RANK={os.environ['ROTA_RANK']!r} is set but ROTA_WORLD_SIZE is not; set both (the "
                          "job's ranks) or neither")
    if os.environ.get("ROTA_WORLD_SIZE"):
        world = env_int("ROTA_WORLD_SIZE", 1, minimum=1)
        rank = env_int("ROTA_RANK", 0, minimum=0)
        if rank >= world:
            raise ConfigError(f"ROTA_RANK={rank} must be below ROTA_WORLD_SIZE={world}")
        return rank, world
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def connect(group: str | None = None, tenant: str | None = None, endpoint: str | None = None, *,
            priority: int | None = None, weight: float | None = None, footprint_hint: int = 0,
            token: str | None = None, devices: str | int | list[str | int] | tuple[str, ...] | None = None) -> Gpu:
    """Join a group as a tenant; defaults come from ``ROTA_*`` (see module docs).

    ``devices``: the devices of this host the job may run on (default ``ROTA_DEVICES``; see
    :mod:`rota.devices`): each turn is placed on one and :attr:`Gpu.device` names it.

    With no orchestrator configured, starts (or finds) the embedded one on this host.
    ``footprint_hint``: device bytes the job will hold once built; with an orchestrator
    that knows the device's size (``--capacity``), its first turn makes room for that much
    (until an adapter reports what it really tracks). ``token``: the bearer token that
    proves this process may act for the job (default ``ROTA_TOKEN``; see :mod:`rota.auth`).
    """
    group = group or os.environ.get("ROTA_GROUP") or "default"
    rank, world = _ranks()
    named = parse_devices(devices, "devices") if devices is not None else env_devices()
    tenant = tenant or os.environ.get("ROTA_TENANT")
    if not tenant:
        if world > 1:
            raise ConfigError(f"a job of {world} ranks needs one job id on every rank: set ROTA_TENANT "
                              "(or pass tenant=) to the same value on all ranks")
        tenant = f"{socket.gethostname().split('.')[0]}-{os.getpid()}"
    if endpoint is None:
        endpoint = os.environ.get("ROTA_ORCHESTRATOR") or ""
        source = "ROTA_ORCHESTRATOR"
    else:
        source = "endpoint"
    if endpoint:
        check_endpoint(endpoint, source)
    else:
        from rota._tenant.local import ensure_local_orchestrator

        endpoint, source = ensure_local_orchestrator(), "this host's embedded orchestrator"
    residue_max_bytes()  # checked now, not at the first park
    prio = priority if priority is not None else env_int("ROTA_PRIORITY", 0, minimum=-(2**31))
    share = weight if weight is not None else env_float("ROTA_WEIGHT", 1.0)
    if share <= 0:
        raise ConfigError(f"weight {share!r} must be > 0")
    return Gpu(group, tenant, endpoint, rank=rank, world_size=world, priority=prio, weight=share,
               heartbeat_s=env_float("ROTA_HEARTBEAT_S", 1.0), footprint_hint=footprint_hint, token=token,
               connect_timeout_s=env_float("ROTA_CONNECT_TIMEOUT_S", CONNECT_TIMEOUT_S), endpoint_source=source,
               devices=named)
