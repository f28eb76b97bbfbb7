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
  :class:`~rota.tensors.HostPool`, carved afresh on every park; the pool grows only
  when the bytes to park exceed its capacity.
* **Asynchronous, batched, one sync.** On CUDA every copy is issued ``non_blocking``
  on the parker's own side stream, ordered after the compute stream's pending work;
  the host waits once per park or restore. Restore allocates on the *current* stream
  (so the caching allocator ties the memory to the stream that will use it) and the
  copies run on the side stream after that.
* **Discard** frees a storage without copying it. On restore a discarded storage comes
  back *zero-filled* (same tensor objects, all bytes zero), never as None: the engine
  only sees tensors, and setting ``.grad = None`` is the adapter's business.
* Tensors on another device than the parker's (e.g. Adam's CPU ``step`` counters of a
  CUDA model) are skipped: they already live on the host.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from rota._types import ParkResult
from rota.tensors._pool import HostPool, align

log = logging.getLogger(__name__)

#: What a tag is fed with: a mapping name -> tensor, a list of tensors, or a callable
#: returning (name, tensor) pairs that is called again on every park (for tensors that
#: appear later, such as optimizer state created by the first step, or new ``.grad``).
NamedTensors = (
    Mapping[str, torch.Tensor] | Sequence[torch.Tensor] | Callable[[], Iterable[tuple[str, torch.Tensor]]]
)


@dataclass
class _Slot:
    """One distinct storage while parked: where its bytes sit in the pool."""

    storage: torch.UntypedStorage
    nbytes: int
    tag: str
    offset: int  # byte offset in the pool; -1 when discarded (nothing copied)


@dataclass
class _Job:
    """A park or restore whose copies are issued but not yet waited for."""

    kind: str
    slots: list[_Slot]
    t0: float
    event: object | None = None


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
    """

    def __init__(self, device: torch.device | str, *, pool: HostPool | None = None,
                 release_cached: bool = True, name: str = "") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cuda = self.device.type == "cuda"
        self.pool = pool or HostPool(pin=self.cuda)
        self.release_cached = release_cached
        self.name = name
        self._sources: dict[str, list[NamedTensors]] = {}
        self._slots: dict[int, _Slot] = {}
        self._resident_by_tag: dict[str, int] = {}
        self._parked = False
        self._lock = threading.RLock()
        self._stream: object | None = None

    # ------------------------------------------------------------ registration

    def add(self, tag: str, tensors: NamedTensors) -> None:
        """Track ``tensors`` under ``tag``. Tags added first own storages shared with later tags."""
        if not tag:
            raise ValueError("a tag must be a non-empty string (e.g. 'weights')")
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

    def _storages(self, tags: Iterable[str] | None = None) -> dict[int, tuple[torch.UntypedStorage, str, str]]:
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
            for s, tag, _ in self._storages().values():
                sizes[tag] += s.nbytes()
            return sizes

    def device_bytes(self) -> dict[str, int]:
        """Device bytes per tag held *now* (zero for parked storages)."""
        sizes = dict.fromkeys(self._sources, 0)
        for s, tag, _ in self._storages().values():
            sizes[tag] += s.nbytes()
        return sizes

    def reserve(self, nbytes: int | None = None, *, background: bool = False) -> float:
        """Size the host pool ahead of the first park (default: current tracked bytes).

        Allocating pinned memory is slow; do it here, off the switch path. With
        ``background=True`` it runs on a thread and the first park waits for it.
        Returns seconds spent (0 when in the background or nothing to grow).
        """
        if nbytes is None:
            nbytes = sum(align(s.nbytes()) for s, _, _ in self._storages().values())
        if background:
            self.pool.reserve_async(nbytes)
            return 0.0
        return self.pool.reserve(nbytes)

    # ------------------------------------------------------------ park/restore

    def park(self, tags: Iterable[str] | None = None, discard: Iterable[str] = ()) -> ParkResult:
        """Copy the storages of ``tags`` (default: all) to the pool, then free them on the device.

        Storages owned by a tag in ``discard`` are freed without copying and come back
        zero-filled. Parking an already parked parker does nothing.
        """
        with self._lock:
            job = self._begin_park(tags, discard)
            return self._finish(job)

    def restore(self) -> ParkResult:
        """Resize every parked storage back and copy its bytes in (zero-fill discarded ones)."""
        with self._lock:
            job = self._begin_restore()
            return self._finish(job)

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
        return torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)

    def _copy_out(self, sl: _Slot, *, non_blocking: bool) -> None:
        dev = self._view(sl.storage)
        parts = self.pool.pieces(sl.offset, sl.nbytes)
        if len(parts) == 1:
            parts[0].copy_(dev, non_blocking=non_blocking)
            return
        at = 0
        for part in parts:
            part.copy_(dev[at:at + part.numel()], non_blocking=non_blocking)
            at += part.numel()

    def _copy_in(self, sl: _Slot, *, non_blocking: bool) -> None:
        dev = self._view(sl.storage)
        parts = self.pool.pieces(sl.offset, sl.nbytes)
        if len(parts) == 1:
            dev.copy_(parts[0], non_blocking=non_blocking)
            return
        at = 0
        for part in parts:
            dev[at:at + part.numel()].copy_(part, non_blocking=non_blocking)
            at += part.numel()

    def _begin_park(self, tags: Iterable[str] | None, discard: Iterable[str]) -> _Job:
        t0 = time.perf_counter()
        if self._parked:
            log.debug("parker %s: already parked", self.name)
            return _Job("noop", [], t0)
        drop = set(discard)
        found = self._storages(tags)
        slots: list[_Slot] = []
        need = 0
        for s, tag, name in found.values():
            n = s.nbytes()
            if n == 0:
                continue
            if not s.resizable():
                raise RuntimeError(f"parker {self.name!r}: tensor {name!r} (tag {tag!r}) has a storage that "
                                   "cannot be resized (from numpy or from_blob?); rota cannot park it")
            if tag in drop:
                slots.append(_Slot(s, n, tag, -1))
            else:
                slots.append(_Slot(s, n, tag, need))
                need += align(n)
        self.pool.wait()
        if need > self.pool.capacity:
            if self.pool.allocations:
                log.warning("parker %s: tracked state grew to %.3f GB; growing the host pool (slow if pinned)",
                            self.name, need / 1e9)
            self.pool.reserve(need)
        job = _Job("park", slots, t0)
        if self.cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for sl in slots:
                    if sl.offset >= 0:
                        self._copy_out(sl, non_blocking=True)
                job.event = stream.record_event()
        else:
            for sl in slots:
                if sl.offset >= 0:
                    self._copy_out(sl, non_blocking=False)
        return job

    def _begin_restore(self) -> _Job:
        return self._issue_restore(self._alloc_restore())

    def _alloc_restore(self) -> _Job:
        """Allocate every parked storage again (on the current stream: the one that will use it).

        Device allocation implicitly synchronises streams, so an overlapped switch
        allocates *before* it issues any copy (see :func:`overlap`).
        """
        t0 = time.perf_counter()
        if not self._parked:
            return _Job("noop", [], t0)
        slots = list(self._slots.values())
        for sl in slots:
            sl.storage.resize_(sl.nbytes)
        return _Job("restore", slots, t0)

    def _issue_restore(self, job: _Job) -> _Job:
        slots = job.slots
        if job.kind == "noop":
            return job
        if self.cuda:
            stream = self._side_stream()
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for sl in slots:
                    if sl.offset >= 0:
                        self._copy_in(sl, non_blocking=True)
                    else:
                        self._view(sl.storage).zero_()
                job.event = stream.record_event()
        else:
            for sl in slots:
                if sl.offset >= 0:
                    self._copy_in(sl, non_blocking=False)
                else:
                    self._view(sl.storage).zero_()
        return job

    def _finish(self, job: _Job) -> ParkResult:
        if job.event is not None:
            job.event.synchronize()  # the one host wait of this park or restore
        by_tag: dict[str, int] = {}
        moved = 0
        for sl in job.slots:
            if sl.offset >= 0:
                by_tag[sl.tag] = by_tag.get(sl.tag, 0) + sl.nbytes
                moved += sl.nbytes
            else:
                by_tag.setdefault(sl.tag, 0)
        if job.kind == "park":
            for sl in job.slots:  # everything is copied out: now free each distinct storage once
                sl.storage.resize_(0)
            self._slots = {sl.storage._cdata: sl for sl in job.slots}
            resident = dict.fromkeys(self._sources, 0)
            for sl in job.slots:
                resident[sl.tag] += sl.nbytes
            self._resident_by_tag = resident
            self._parked = True
            if self.cuda and self.release_cached:
                torch.cuda.empty_cache()
        elif job.kind == "restore":
            self._slots = {}
            self._parked = False
        seconds = time.perf_counter() - job.t0
        if job.kind != "noop":
            log.debug("parker %s: %s %d storages, %.3f GB in %.4f s", self.name, job.kind, len(job.slots),
                      moved / 1e9, seconds)
        return ParkResult(bytes_moved=moved, seconds=seconds, by_tag=by_tag)


ParkSpec = TensorParker | tuple[TensorParker, Iterable[str] | None, Iterable[str]]


def overlap(park: Sequence[ParkSpec] | TensorParker = (),
            restore: Sequence[TensorParker] | TensorParker = ()) -> tuple[ParkResult, ParkResult]:
    """Park ``park`` while restoring ``restore``, each parker on its own stream.

    ``park`` items are parkers (park every tag) or ``(parker, tags, discard)`` tuples
    with the arguments of :meth:`TensorParker.park`.

    PCIe is full duplex: device-to-host copies of the outgoing tenant and host-to-device
    copies of the incoming one run at the same time. All copies are issued before any
    wait. The device must have room for both while the switch runs (the outgoing
    memory is freed only after its copies finish). Returns (park result, restore
    result); both carry the wall time of the whole switch.
    """
    specs = [park] if isinstance(park, TensorParker) else list(park)
    specs = [(p, None, ()) if isinstance(p, TensorParker) else p for p in specs]
    parks = [p for p, _, _ in specs]
    restores = [restore] if isinstance(restore, TensorParker) else list(restore)
    everyone = parks + restores
    if len({id(p) for p in everyone}) != len(everyone):
        raise ValueError("overlap: a parker appears twice; park and restore distinct parkers")
    t0 = time.perf_counter()
    for p in everyone:
        p._lock.acquire()
    try:
        # Allocate first: a device allocation would otherwise wait for the copies in flight.
        jobs_in = [p._alloc_restore() for p in restores]
        jobs_out = [p._begin_park(tags, discard) for p, tags, discard in specs]
        jobs_in = [p._issue_restore(j) for p, j in zip(restores, jobs_in, strict=True)]
        into = [p._finish(j) for p, j in zip(restores, jobs_in, strict=True)]  # parks free (and sync) last
        out = [p._finish(j) for p, j in zip(parks, jobs_out, strict=True)]
    finally:
        for p in everyone:
            p._lock.release()
    seconds = time.perf_counter() - t0
    return _sum(out, seconds), _sum(into, seconds)


def _sum(results: list[ParkResult], seconds: float) -> ParkResult:
    total = ParkResult(seconds=seconds)
    for r in results:
        total.bytes_moved += r.bytes_moved
        for tag, n in r.by_tag.items():
            total.by_tag[tag] = total.by_tag.get(tag, 0) + n
    return total
