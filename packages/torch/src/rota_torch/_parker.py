"""TensorParker: park tagged tensors into a host pool by distinct storage, and back.

Who calls it: torch adapters (``rota_fsdp.track`` builds one per tracked model) from
their ``rota_park``/``rota_restore`` hooks, and ``bench/switch.py``.

Invariants, and why:

* **By storage, not by tensor.** Tensors share untyped storages (views, FSDP2 shards
  and their padded flat buffers, reduce-scatter outputs that back several grads). A
  park first collects the *distinct* storages (keyed by the storage object's C
  address, which survives ``resize_``), copies every one out, synchronises once, and
  only then frees each storage once with ``resize_(0)``. Freeing tensor by tensor and
  then touching a sharer crashed FSDP2 with SIGSEGV.
* **Identities survive.** Nothing is reallocated at the Python level: restore resizes
  the same storage objects back to their byte size and copies in, so parameters,
  optimizer-state tensors, views and ``DTensor`` wrappers keep pointing at valid data.
* **One pool, no allocation per switch.** Copies go into slots of one
  :class:`~rota_torch.HostPool`, carved afresh on every park; the pool grows only
  when the bytes to park exceed its capacity.
* **Asynchronous, batched, one sync.** On CUDA every copy is issued ``non_blocking``
  on the parker's own side stream, ordered after the compute stream's pending work;
  the host waits once per park or restore. Restore allocates on the *current* stream
  (so the caching allocator ties the memory to the stream that will use it) and the
  copies run on the side stream after that, batch by batch (:data:`RESTORE_BATCH`).
* **Discard** frees a storage without copying it. On restore a discarded storage comes
  back *zero-filled* (same tensor objects, all bytes zero), never as None: the parker
  only sees tensors, and setting ``.grad = None`` is the adapter's business.
* Tensors on another device than the parker's (e.g. Adam's CPU ``step`` counters of a
  CUDA model) are skipped: they already live on the host.
* **Transactional.** A park frees nothing until every copy is done (and its deadline
  has not passed): a park that fails or times out leaves the tenant resident. A
  restore checks first (discarded tags it cannot re-create, sampled fingerprints of
  the host copy, free device memory for the whole footprint), then allocates, copies
  and (``verify="full"``) compares device checksums; any failure frees what it
  allocated and the parker stays parked with its host copy intact. See
  :mod:`rota_torch._guard` for the modes and environment variables.
* **Staged restore.** Regions come back in tag order weights, optimizer, grads, then
  everything else (caches), so the state a step needs first is on the device first.
* **Discard is explicit.** A discarded tag is listed in ``ParkResult.discarded`` (or
  ``recreated`` when its ``on_discard`` callback rebuilt it), never in ``by_tag`` of a
  restore; a tag added with ``on_discard="error"`` makes the restore fail naming it.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from rota.config import env_float
from rota.types import ParkResult
from rota_torch._copies import Job, Slot, copy_in, copy_out, copy_runs, reserve_segment, restore_batches, storage_view
from rota_torch._guard import (
    Deadline,
    DiscardedTag,
    HostSample,
    NoRoom,
    check_non_negative,
    check_restored_sums,
    check_verify,
    device_checksum,
    device_free_bytes,
    env_verify,
    host_sums,
)
from rota_torch._pool import HostPool, align

log = logging.getLogger(__name__)

LARGE_ALLOC = 1 << 20  # the CUDA caching allocator serves storages of at least this size from its large pool
RESTORE_BATCH = 1 << 29  # a restore on its own allocates, then issues the copies of, this many bytes at a time
#: Restore order: the state a step needs first comes back first; unknown tags (caches) last.
STAGE_ORDER = {"weights": 0, "optimizer": 1, "grads": 2}

#: What a tag is fed with: a mapping name -> tensor, a list of tensors, or a callable
#: returning (name, tensor) pairs that is called again on every park (for tensors that
#: appear later, such as optimizer state created by the first step, or new ``.grad``).
NamedTensors = (
    Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Callable[[], Iterable[tuple[str, torch.Tensor]]]
)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds ``t``'s bytes on this rank (unwraps ``DTensor``)."""
    inner = getattr(t, "_local_tensor", None)
    return inner if isinstance(inner, torch.Tensor) else t


def storage_key(t: torch.Tensor) -> int:
    """Identity of ``t``'s untyped storage; stable across ``resize_``."""
    return local_tensor(t).untyped_storage()._cdata


class TensorParker:
    """Parks and restores the tensors registered under tags, keeping their identities.

    :param device: the device whose tensors are parked; others are skipped.
    :param pool: host pool to copy into (default: a new one, pinned if CUDA).
    :param release_cached: on CUDA, return freed memory to the driver after a park
        (``torch.cuda.empty_cache``) so *another process* can use it. Default True.
    :param name: for logs.
    :param verify: ``off``, ``sample`` or ``full`` (default ``ROTA_VERIFY``, else ``sample``).
    :param deadline_s: seconds one park or restore may take before it is rolled back
        (default ``ROTA_SWITCH_DEADLINE_S``; 0 = no deadline).
    :param free_bytes: how to learn the device's free bytes before a restore (default:
        CUDA ``mem_get_info`` plus this process's cached blocks; unknown on CPU).
    """

    def __init__(self, device: torch.device | str, *, pool: HostPool | None = None,
                 release_cached: bool = True, name: str = "", verify: str | None = None,
                 deadline_s: float | None = None,
                 free_bytes: Callable[[torch.device], int | None] = device_free_bytes) -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.pool = pool or HostPool(pin=self.cuda)
        self.release_cached = release_cached
        self.name = name
        self._sources: dict[str, list[NamedTensors]] = {}
        self._slots: dict[int, Slot] = {}
        self._sample = HostSample()  # verify="sample": sampled host bytes of the current park
        self._resident_by_tag: dict[str, int] = {}
        self._parked = False
        self._lock = threading.RLock()
        self._stream: object | None = None
        self.verify = check_verify(verify) if verify is not None else env_verify()
        check_non_negative("deadline_s", deadline_s)
        self.deadline_s = deadline_s if deadline_s is not None else \
            env_float("ROTA_SWITCH_DEADLINE_S", 0.0, minimum=0.0)
        self.free_bytes = free_bytes
        # how long a restore waits for free memory
        self.room_wait_s = env_float("ROTA_RESTORE_ROOM_WAIT_S", 10.0, minimum=0.0)
        self._on_discard: dict[str, str | Callable[[], None]] = {}
        self.last_residue: dict[str, int] = {}
        #: seconds of the last park's or restore's phases (collect, pool, issue, wait, free, ...), for benchmarks
        self.last_phases: dict[str, float] = {}
        self._pool_wait_check: Callable[[], None] | None = None

    # ------------------------------------------------------------ registration

    def add(self, tag: str, tensors: NamedTensors, *, on_discard: str | Callable[[], None] = "zeros") -> None:
        """Track ``tensors`` under ``tag``. Tags added first own storages shared with later tags.

        ``on_discard`` says what a restore does with the tag after a discard-mode park:
        ``"zeros"`` (come back zero-filled, e.g. grads), ``"error"`` (the restore fails
        naming the tag), or a callable run after the restore that re-creates the values.
        """
        if not tag:
            raise ValueError("a tag must be a non-empty string (e.g. 'weights')")
        if not callable(on_discard) and on_discard not in ("zeros", "error"):
            raise ValueError(f"on_discard={on_discard!r} for tag {tag!r}: use 'zeros', 'error' or a callable")
        self._on_discard[tag] = on_discard
        with self._lock:
            if self._parked:
                raise RuntimeError(f"parker {self.name!r}: cannot add tensors while parked; restore first")
            self._sources.setdefault(tag, []).append(tensors)

    @property
    def tags(self) -> tuple[str, ...]:
        """Tags in the order they were added."""
        return tuple(self._sources)

    @property
    def parked(self) -> bool:
        """True between a park and the next restore."""
        return self._parked

    def named_tensors(self, tags: Iterable[str] | None = None) -> Iterator[tuple[str, str, torch.Tensor]]:
        """Every tracked (tag, name, tensor) now, sources re-evaluated, ``DTensor`` unwrapped."""
        wanted = None if tags is None else set(tags)
        for tag, sources in list(self._sources.items()):
            if wanted is not None and tag not in wanted:
                continue
            for source in sources:
                if callable(source):
                    items: Iterable[tuple[str, torch.Tensor]] = source()
                elif isinstance(source, Mapping):
                    items = source.items()
                else:
                    items = ((str(i), t) for i, t in enumerate(source))
                for name, t in items:
                    if isinstance(t, torch.Tensor):
                        yield tag, name, local_tensor(t)

    # ------------------------------------------------------------------ sizes

    @property
    def lock(self) -> threading.RLock:
        """Held by every park and restore: hold it to read the tracked tensors while nothing moves them."""
        return self._lock

    def tracked_keys(self) -> set[int]:
        """Storage keys (``untyped_storage()._cdata``) this parker parks: on the device now, or parked."""
        with self._lock:
            return set(self.storages()) | set(self._slots)

    def storages(self, tags: Iterable[str] | None = None) -> dict[int, tuple[torch.UntypedStorage, str, str]]:
        """Distinct storages on our device: key -> (storage, owning tag, first tensor name)."""
        out: dict[int, tuple[torch.UntypedStorage, str, str]] = {}
        for tag, name, t in self.named_tensors(tags):
            if t.device != self.device or t.is_meta:
                continue
            s = t.untyped_storage()
            key = s._cdata
            if key not in out:
                out[key] = (s, tag, name)
        return out

    def footprint(self) -> dict[str, int]:
        """Device bytes per tag when resident (while parked: what restore brings back)."""
        with self._lock:
            if self._parked:
                return dict(self._resident_by_tag)
            sizes = dict.fromkeys(self._sources, 0)
            for s, tag, _ in self.storages().values():
                sizes[tag] += s.nbytes()
            return sizes

    def device_bytes(self) -> dict[str, int]:
        """Device bytes per tag held *now* (zero for parked storages)."""
        sizes = dict.fromkeys(self._sources, 0)
        for s, tag, _ in self.storages().values():
            sizes[tag] += s.nbytes()
        return sizes

    def reserve(self, nbytes: int | None = None, *, background: bool = False) -> float:
        """Size the host pool ahead of the first park (default: current tracked bytes).

        Allocating pinned memory is slow; do it here, off the switch path. With
        ``background=True`` it runs on a thread and the first park waits for it.
        Returns seconds spent (0 when in the background or nothing to grow).
        """
        if nbytes is None:
            nbytes = sum(align(s.nbytes()) for s, _, _ in self.storages().values())
        if background:
            self.pool.reserve_async(nbytes)
            return 0.0
        return self.pool.reserve(nbytes)

    # ------------------------------------------------------------ park/restore

    def park(self, tags: Iterable[str] | None = None, discard: Iterable[str] = (),
             deadline_s: float | None = None) -> ParkResult:
        """Copy the storages of ``tags`` (default: all) to the pool, then free them on the device.

        Storages owned by a tag in ``discard`` are freed without copying. Parking an
        already parked parker does nothing. ``deadline_s`` (default: the parker's)
        bounds the park; past it nothing is freed and :class:`SwitchTimeout` is raised.
        ``ParkResult.residue`` holds the device bytes of tracked tags left behind.
        """
        with self._lock:
            job = self._begin_park(tags, discard, deadline_s)
            return self._finish(job)

    def restore(self, deadline_s: float | None = None) -> ParkResult:
        """Check, reserve, then bring every parked storage back (staged: weights first).

        :raises DiscardedTag: a discarded tag added with ``on_discard="error"``.
        :raises VerifyError: the host copy (sample) or the restored bytes (full) differ
            from what was parked; the parker stays parked.
        :raises NoRoom: the device has less free memory than the footprint.
        :raises SwitchTimeout: past ``deadline_s``; rolled back, still parked.
        """
        with self._lock:
            job = self._begin_restore(deadline_s)
            return self._finish(job)

    def residue(self) -> dict[str, int]:
        """Device bytes that tracked tags still hold (all zero right after a full park)."""
        with self._lock:
            return {tag: n for tag, n in self.device_bytes().items() if n}

    def host_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """A fresh CPU copy of tracked tensor ``t``, from the host pool while parked.

        Needs no device and no turn: this is what checkpoints of a parked tenant are
        written from. When not parked, copies from the device. A discarded tensor
        reads as zeros (what restore will give back).
        """
        t = local_tensor(t)
        with self._lock:
            slot = self._slots.get(t.untyped_storage()._cdata) if self._parked else None
            if slot is None:
                if t.untyped_storage().nbytes() == 0 and t.numel() > 0:
                    raise RuntimeError(f"parker {self.name!r}: tensor is freed but not parked here")
                return t.detach().to("cpu", copy=True)
            if slot.offset < 0:
                return torch.zeros(t.shape, dtype=t.dtype)
            raw = self.pool.view(slot.offset, slot.nbytes)
            view = torch.empty(0, dtype=t.dtype).set_(
                raw.untyped_storage(), raw.storage_offset() // t.element_size() + t.storage_offset(), t.size(),
                t.stride())
            return view.clone()

    # -------------------------------------------------------------- internals

    def _side_stream(self) -> object:
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def _view(self, storage: torch.UntypedStorage) -> torch.Tensor:
        return storage_view(storage, self.device)

    def _copy_out(self, sl: Slot, *, non_blocking: bool) -> None:
        copy_out(self.pool, self.device, sl, non_blocking=non_blocking, who=f"parker {self.name!r}")

    def _copy_in(self, sl: Slot, *, non_blocking: bool) -> None:
        copy_in(self.pool, self.device, sl, non_blocking=non_blocking)

    def _copy_runs(self, slots: list[Slot], *, into_device: bool) -> None:
        copy_runs(self.pool, self.device, slots, into_device=into_device, wait_check=self._pool_wait_check,
                  who=f"parker {self.name!r}")

    def _begin_park(self, tags: Iterable[str] | None, discard: Iterable[str],
                    deadline_s: float | None = None) -> Job:
        t0 = time.perf_counter()
        if self._parked:
            log.debug("parker %s: already parked", self.name)
            return Job("noop", [], t0)
        deadline = Deadline(self.deadline_s if deadline_s is None else deadline_s, f"park of {self.name!r}")
        drop = set(discard)
        found = self.storages(tags)
        slots: list[Slot] = []
        need = 0
        for s, tag, name in found.values():
            n = s.nbytes()
            if n == 0:
                continue
            if not s.resizable():
                raise RuntimeError(f"parker {self.name!r}: tensor {name!r} (tag {tag!r}) has a storage that "
                                   "cannot be resized (from numpy or from_blob?); rota cannot park it")
            if tag in drop:
                slots.append(Slot(s, n, tag, -1, name))
            else:
                slots.append(Slot(s, n, tag, need, name))
                need += align(n)
        deadline.check("collecting tensors")
        job = Job("park", slots, t0, deadline=deadline)
        job.mark("collect")
        if need > self.pool.target_bytes:  # no reservation under way covers it: grow now (the first chunks of
            self.pool.wait()  # one under way are copied into while the rest is pinned, below)
            if need > self.pool.capacity:
                if self.pool.allocations:
                    log.warning("parker %s: tracked state grew to %.3f GB; growing the host pool (slow if pinned)",
                                self.name, need / 1e9)
                self.pool.reserve(need)
        job.mark("grow_pool")
        self._pool_wait_check = lambda: deadline.check("waiting for the host pool to be pinned")
        copied = [sl for sl in slots if sl.offset >= 0]
        if self.cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._copy_runs(copied, into_device=False)
                if self.verify == "full":
                    job.sums = [device_checksum(self._view(sl.storage)) for sl in copied]
                job.event = stream.record_event()
            if self.verify == "sample":
                self._sample.prepare(copied)  # while the copies run
            job.mark("issue")
        else:
            for sl in copied:
                deadline.check(f"copying {sl.name!r} (tag {sl.tag!r})")
                self.pool.wait_for(sl.offset + sl.nbytes, self._pool_wait_check)
                self._copy_out(sl, non_blocking=False)
            if self.verify == "full":
                job.sums = [device_checksum(self._view(sl.storage)) for sl in copied]
        return job

    def _begin_restore(self, deadline_s: float | None = None) -> Job:
        """A restore on its own, pipelined: the copies of the first :data:`RESTORE_BATCH` bytes run while the
        next are allocated, and the sampled check of the host copy runs while the copies do (a mismatch rolls the
        restore back like any failure: the tenant stays parked). Why: on an H200 the checks, the allocation and
        the first issue kept the device idle for 7-14 ms of a 0.37 s 20 GB restore, 5 ms of a 0.08 s 4 GB one."""
        job = self._check_restore(deadline_s, sample=False)
        if job.kind == "noop":
            return job
        try:
            self._reserve(job)
            # small storages first: one may need a new small-pool segment from the driver, which would wait for
            # the copies in flight; large ones are carved out of the reserved block, which asks nothing
            self._allocate([sl for sl in job.slots if sl.nbytes < LARGE_ALLOC])
            for batch in restore_batches(job.slots, RESTORE_BATCH):
                self._allocate(batch)
                self._issue_slots(job, batch)
            job.mark("allocate_issue")
            if self.verify == "sample" and self._sample.taken:
                job.verify_s += self._check_sample()
                job.mark("check_host")
            self._close_issue(job)
        except BaseException:
            self._rollback_restore(job)
            raise
        return job

    def _check_restore(self, deadline_s: float | None, *, sample: bool) -> Job:
        """The checks before a restore allocates: discarded tags can be re-created, the sampled host windows
        match (``verify="sample"``, when ``sample``) and the device has room for the whole footprint."""
        t0 = time.perf_counter()
        if not self._parked:
            return Job("noop", [], t0)
        deadline = Deadline(self.deadline_s if deadline_s is None else deadline_s, f"restore of {self.name!r}")
        slots = sorted(self._slots.values(), key=lambda sl: STAGE_ORDER.get(sl.tag, len(STAGE_ORDER)))
        refuse = sorted({sl.tag for sl in slots if sl.offset < 0 and self._on_discard.get(sl.tag) == "error"})
        if refuse:
            raise DiscardedTag(f"parker {self.name!r}: tag(s) {refuse} were discarded at park and cannot be "
                               "re-created (added with on_discard='error'); reload them or park them in offload "
                               "mode; the tenant stays parked")
        verify_s = self._check_sample() if sample and self.verify == "sample" and self._sample.taken else 0.0
        need = sum(sl.nbytes for sl in slots)
        free = self._wait_for_room(need, deadline)
        if free is not None and need > free:
            raise NoRoom(f"parker {self.name!r}: restore needs {need / 1e9:.3f} GB on {self.device} but only "
                         f"{free / 1e9:.3f} GB is free after waiting {self.room_wait_s:g} s "
                         "(ROTA_RESTORE_ROOM_WAIT_S); nothing was allocated, the tenant stays parked")
        deadline.check("checks before allocating")
        job = Job("restore", slots, t0, deadline=deadline, verify_s=verify_s)
        job.mark("check")
        return job

    def _alloc_restore(self, deadline_s: float | None = None) -> Job:
        """Check, then allocate every parked storage again (on the current stream: the one that will use it).

        Nothing is allocated unless every check passes. Device allocation implicitly
        synchronises streams, so an overlapped switch allocates *before* it issues any
        copy (see :func:`overlap`).
        """
        job = self._check_restore(deadline_s, sample=True)
        if job.kind == "noop":
            return job
        try:
            self._reserve(job)
            self._allocate(job.slots)
        except BaseException:
            for sl in job.slots:
                sl.storage.resize_(0)
            raise
        job.mark("allocate")
        return job

    def _check_sample(self) -> float:
        """The sampled words of the host copy against the park's (:class:`VerifyError` if they differ); seconds."""
        tv = time.perf_counter()
        self._sample.check(self.pool, f"parker {self.name!r}")
        return time.perf_counter() - tv

    def _reserve(self, job: Job) -> None:
        if self.cuda and self.release_cached:
            reserve_segment(self.device, job.slots, LARGE_ALLOC)
            job.mark("reserve_segment")

    @staticmethod
    def _allocate(slots: list[Slot]) -> None:
        """Give each storage its bytes again (those not given them yet), on the current stream."""
        for sl in slots:
            if sl.storage.nbytes() != sl.nbytes:
                sl.storage.resize_(sl.nbytes)

    def _wait_for_room(self, need: int, deadline: Deadline) -> int | None:
        """The device's free bytes, polled until ``need`` fits, ``room_wait_s`` passes or the deadline nears.

        Why: a tenant that has just ended (or parked through another process) gives its
        memory back to the driver a moment after the orchestrator learns it is gone; a
        restore granted in that moment waits for it instead of failing the turn.
        """
        free = self.free_bytes(self.device)
        until = time.monotonic() + min(self.room_wait_s, max(deadline.left(), 0.0))
        while free is not None and need > free and time.monotonic() < until:
            time.sleep(0.05)
            free = self.free_bytes(self.device)
        return free

    def _issue_restore(self, job: Job) -> Job:
        if job.kind == "noop":
            return job
        try:
            self._issue_slots(job, job.slots)
            self._close_issue(job)
            job.mark("issue")
        except BaseException:
            self._rollback_restore(job)
            raise
        return job

    def _issue_slots(self, job: Job, slots: list[Slot]) -> None:
        """Copies back into allocated ``slots`` (zeros for discarded ones): on CUDA issued on the side stream after
        the current stream's work, elsewhere done here."""
        if self.cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                self._copy_runs([sl for sl in slots if sl.offset >= 0], into_device=True)
                for sl in slots:
                    if sl.offset < 0:
                        self._view(sl.storage).zero_()
            return
        for sl in slots:
            if job.deadline is not None:
                job.deadline.check(f"copying {sl.name!r} (tag {sl.tag!r}) back")
            if sl.offset >= 0:
                self._copy_in(sl, non_blocking=False)
            else:
                self._view(sl.storage).zero_()

    def _close_issue(self, job: Job) -> None:
        """After the last copy of a restore: its checksums (``verify="full"``) and, on CUDA, the event waited for."""
        with torch.cuda.stream(self._side_stream()) if self.cuda else contextlib.nullcontext():
            if self.verify == "full":
                job.sums = [device_checksum(self._view(sl.storage)) for sl in job.slots if sl.offset >= 0]
            if self.cuda:
                job.event = self._side_stream().record_event()

    def _rollback_restore(self, job: Job) -> None:
        """Free what a failed restore allocated; the parker stays parked with its host copy."""
        if self.cuda:  # the frees must come after any copy still in flight on the side stream
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream())
        for sl in job.slots:
            sl.storage.resize_(0)
        log.warning("parker %s: restore rolled back; still parked", self.name)

    def _wait(self, job: Job) -> None:
        """The one host wait of a park or restore, bounded by its deadline."""
        if job.event is None:
            return
        if job.deadline is None or job.deadline.seconds == 0:
            job.event.synchronize()
            return
        pause = 1e-4
        while not job.event.query():
            job.deadline.check("waiting for the copies")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def _finish(self, job: Job) -> ParkResult:
        if job.kind == "restore":
            try:
                self._wait(job)
                if self.verify == "full" and job.sums:
                    tv = time.perf_counter()
                    copied = [sl for sl in job.slots if sl.offset >= 0]
                    check_restored_sums(f"parker {self.name!r}", copied, host_sums(job.sums))
                    job.verify_s += time.perf_counter() - tv
            except BaseException:
                self._rollback_restore(job)
                raise
        else:
            self._wait(job)  # a park past its deadline raises here, before anything is freed
        if job.kind != "noop":
            job.mark("wait")
        by_tag: dict[str, int] = {}
        moved = 0
        discarded: list[str] = []
        for sl in job.slots:
            if sl.offset >= 0:
                by_tag[sl.tag] = by_tag.get(sl.tag, 0) + sl.nbytes
                moved += sl.nbytes
            else:
                by_tag.setdefault(sl.tag, 0)
                if sl.tag not in discarded:
                    discarded.append(sl.tag)
        result = ParkResult(bytes_moved=moved, by_tag=by_tag, host_bytes=self.pool.capacity,
                            spilled_bytes=self.pool.spilled_bytes)
        if job.kind == "park":
            tv = time.perf_counter()
            copied = [sl for sl in job.slots if sl.offset >= 0]
            self._sample.clear()
            if self.verify == "sample":
                self._sample.take(self.pool, copied)
            elif self.verify == "full" and job.sums is not None:
                for sl, fp in zip(copied, host_sums(job.sums), strict=True):
                    sl.fp = fp
            result.verify_seconds = time.perf_counter() - tv
            job.mark("verify")
            for sl in job.slots:  # everything is copied out: now free each distinct storage once
                sl.storage.resize_(0)
            self._slots = {sl.storage._cdata: sl for sl in job.slots}
            resident = dict.fromkeys(self._sources, 0)
            for sl in job.slots:
                resident[sl.tag] += sl.nbytes
            self._resident_by_tag = resident
            self._parked = True
            job.mark("free")
            if self.cuda and self.release_cached:
                torch.cuda.empty_cache()
                job.mark("empty_cache")
            result.residue = self.residue()
            if self.cuda:
                result.residue["process:allocated"] = int(torch.cuda.memory_allocated(self.device))
                result.residue["process:reserved"] = int(torch.cuda.memory_reserved(self.device))
            result.discarded = discarded
            self.last_residue = dict(result.residue)
        elif job.kind == "restore":
            result.verify_seconds = job.verify_s
            self._slots = {}
            self._sample.clear()
            self._parked = False
            for tag in discarded:
                by_tag.pop(tag, None)
                action = self._on_discard.get(tag, "zeros")
                if callable(action):
                    action()
                    result.recreated.append(tag)
                else:
                    result.discarded.append(tag)
        if job.kind != "noop":
            job.mark("finish")
            self.last_phases = dict(job.phases or {})
        seconds = time.perf_counter() - job.t0
        result.seconds = seconds
        if job.kind != "noop":
            log.debug("parker %s: %s %d storages, %.3f GB in %.4f s", self.name, job.kind, len(job.slots),
                      moved / 1e9, seconds)
        return result
