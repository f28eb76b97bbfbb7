"""What a park holds per storage (:class:`Slot`), a switch in flight (:class:`Job`), and the copies between them.

Who calls it: :class:`rota_torch.TensorParker` only. Copies go one per *run* of storages that lie back to
back on the device and in the pool (:func:`device_runs`), not one per storage: a tenant's hundreds of
storages are a few copies once a restore has carved them out of one block; a run never crosses from one driver
allocation into another, even where the two lie back to back in the address space. A park copies a run only once
the pool has pinned its bytes (:meth:`rota_torch.HostPool.wait_for`), so the first park after ``track``
copies into the chunks already pinned while the rest are pinned.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from rota_torch._guard import Deadline, StateChanged
from rota_torch._pool import HostPool, align

__all__ = ["Job", "Slot", "allocation_range", "copy_in", "copy_out", "copy_runs", "device_runs",
           "raw_device_bytes", "reserve_segment", "restore_batches",
           "storage_view"]

RANGE_START_ADDR, RANGE_SIZE = 11, 12  # CU_POINTER_ATTRIBUTE_RANGE_START_ADDR and _RANGE_SIZE (driver API)


@dataclass
class Slot:
    """One distinct storage while parked: where its bytes sit in the pool."""

    storage: torch.UntypedStorage
    nbytes: int
    tag: str
    offset: int  # byte offset in the pool; -1 when discarded (nothing copied)
    name: str = ""  # first tensor seen on this storage (for error messages)
    fp: object = None  # full mode: the (words, tail) device checksum taken at park


@dataclass
class Job:
    """A park or restore whose copies are issued but not yet waited for."""

    kind: str
    slots: list[Slot]
    t0: float
    event: object | None = None
    deadline: Deadline | None = None
    sums: list[object] | None = None  # full-mode device checksums, one per copied slot
    verify_s: float = 0.0
    phases: dict[str, float] | None = None  # seconds per phase, in order (see TensorParker.last_phases)
    last_mark: float = 0.0

    def mark(self, phase: str) -> None:
        """The phase that just ended took the time since the previous mark (or the start)."""
        now = time.perf_counter()
        if self.phases is None:
            self.phases, self.last_mark = {}, self.t0
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.last_mark
        self.last_mark = now


def restore_batches(slots: list[Slot], nbytes: int) -> Iterator[list[Slot]]:
    """``slots`` in order, cut into consecutive batches of at least ``nbytes`` (the last may hold less)."""
    batch: list[Slot] = []
    size = 0
    for sl in slots:
        batch.append(sl)
        size += sl.nbytes
        if size >= nbytes:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def reserve_segment(device: torch.device, slots: list[Slot], large_alloc: int) -> None:
    """Ask the driver once for a restore's large storages (of ``large_alloc`` bytes and more), then hand the block
    to the caching allocator.

    After a park that returned memory to the driver, every storage of the restore would otherwise be its own
    ``cudaMalloc`` (hundreds per tenant: about 30% of a 4 GB restore). Freed at once, the block stays cached and
    the allocator carves the storages out of it. Smaller storages come from the allocator's small pool and are
    not covered. If the block does not fit, the storages are allocated one by one as before.
    """
    large = sum(align(sl.nbytes) for sl in slots if sl.nbytes >= large_alloc)
    if large < 2 * large_alloc:
        return
    try:
        block = torch.empty(large, dtype=torch.uint8, device=device)
    except torch.OutOfMemoryError:
        return
    del block


def storage_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    """The storage's bytes as a uint8 tensor (on ``device``)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


@functools.cache
def _pointer_attribute() -> Callable[..., int] | None:
    """The driver's ``cuPointerGetAttribute``; None where no CUDA driver can be loaded."""
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuPointerGetAttribute
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64]
    fn.restype = ctypes.c_int
    return fn


def allocation_range(ptr: int) -> tuple[int, int] | None:
    """(start, size) of the driver allocation holding device address ``ptr``; None where the driver cannot say."""
    fn = _pointer_attribute()
    start, size = ctypes.c_uint64(0), ctypes.c_uint64(0)
    if fn is None or fn(ctypes.byref(start), RANGE_START_ADDR, ptr) or fn(ctypes.byref(size), RANGE_SIZE, ptr):
        return None
    return start.value, size.value


def device_runs(slots: list[Slot],
                allocation_of: Callable[[int], tuple[int, int] | None] = allocation_range) -> list[list[Slot]]:
    """``slots`` (in pool order) grouped into runs that lie back to back both in the pool and on the device.

    Storages restored together are carved out of one block, so after the first restore a tenant's state is a
    few runs. A run spans the padding between two storages only where that padding is the first storage's
    own: no gap, or a gap under the 512-byte rounding of the caching allocator, when that allocator made them.
    A run stays inside one driver allocation (``allocation_of`` its first storage, asked once per run): two
    ``cudaMalloc`` segments can lie back to back in the address space, and one copy across both fails with
    "invalid argument" (a TRL job's park on the H200 at 49a8a30). Where the driver cannot say, nothing merges.
    """
    native: bool | None = None
    runs: list[list[Slot]] = []
    within: tuple[int, int] | None = None  # the current run's allocation, asked once it has a storage to merge
    for sl in slots:
        if runs:
            prev = runs[-1][-1]
            step = align(prev.nbytes)
            gap = step - prev.nbytes
            ptr = sl.storage.data_ptr()
            if sl.offset == prev.offset + step and ptr == prev.storage.data_ptr() + step:
                if gap and native is None:
                    native = torch.cuda.memory.get_allocator_backend() == "native"
                if not gap or native:
                    if within is None:
                        within = allocation_of(runs[-1][0].storage.data_ptr())
                    if within is not None and within[0] <= ptr and ptr + sl.nbytes <= within[0] + within[1]:
                        runs[-1].append(sl)
                        continue
        runs.append([sl])
        within = None
    return runs


class _Span:
    """Device bytes at an address, for ``torch.as_tensor`` (CUDA array interface): a view that owns nothing."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


def raw_device_bytes(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` of device memory at ``ptr`` that it does not own."""
    return torch.as_tensor(_Span(ptr, nbytes), device=device)


def check_unchanged(sl: Slot, who: str) -> None:
    """The storage still has the bytes the park collected; else the park fails naming it (nothing is freed)."""
    now = sl.storage.nbytes()
    if now != sl.nbytes:
        raise StateChanged(
            f"{who}: tensor {sl.name!r} (tag {sl.tag!r}) went from {sl.nbytes} to {now} bytes while it was being "
            "parked: other code freed or resized a tracked tensor between turns (e.g. at the end of a run). Free "
            "or change tracked tensors only inside a turn or inside gpu.hold_state(); nothing was freed, the "
            "tenant stays resident")


def copy_out(pool: HostPool, device: torch.device, sl: Slot, *, non_blocking: bool, who: str) -> None:
    """Device -> pool, one storage."""
    check_unchanged(sl, who)
    pool.transfer(storage_view(sl.storage, device), sl.offset, to_host=True, non_blocking=non_blocking)


def copy_in(pool: HostPool, device: torch.device, sl: Slot, *, non_blocking: bool) -> None:
    """Pool -> device, one storage."""
    pool.transfer(storage_view(sl.storage, device)[:sl.nbytes], sl.offset, to_host=False, non_blocking=non_blocking)


def copy_runs(pool: HostPool, device: torch.device, slots: list[Slot], *, into_device: bool,
              wait_check: Callable[[], None] | None, who: str) -> None:
    """Issue the asynchronous copies of ``slots`` (copied ones, in pool order) on the current stream, one per run,
    each once the pool holds its bytes; the pool's pinning registers nothing while copies are being issued
    (:meth:`rota_torch.HostPool.copying`)."""
    with pool.copying():
        _issue_runs(pool, device, slots, into_device=into_device, wait_check=wait_check, who=who)


def _issue_runs(pool: HostPool, device: torch.device, slots: list[Slot], *, into_device: bool,
                wait_check: Callable[[], None] | None, who: str) -> None:
    for run in device_runs(slots):
        first, last = run[0], run[-1]
        pool.wait_for(last.offset + last.nbytes, wait_check)
        if len(run) == 1:
            if into_device:
                copy_in(pool, device, first, non_blocking=True)
            else:
                copy_out(pool, device, first, non_blocking=True, who=who)
            continue
        if not into_device:
            for sl in run:
                check_unchanged(sl, who)
        span = last.offset - first.offset + last.nbytes
        pool.transfer(raw_device_bytes(first.storage.data_ptr(), span, device), first.offset,
                      to_host=not into_device, non_blocking=True)
