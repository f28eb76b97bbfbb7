"""The host pool: one host buffer that parked storages are copied into.

Pinning host memory is slow (a 20 GB pinned buffer took 24 s on an H200 host), and a
pageable destination halves copy bandwidth. So a parker allocates its pool once, ahead
of the first park and ideally in the background (:meth:`HostPool.reserve_async`), and
carves it into slots on every park. The pool only grows, and only when the bytes to
park exceed its capacity; :attr:`HostPool.allocations` counts every allocation so a
test can show that switching allocates nothing.

Used by :class:`rota.tensors.TensorParker`; thread-safe (a background reservation may
race with the first park, which waits for it).
"""

from __future__ import annotations

import logging
import threading
import time

import torch

log = logging.getLogger(__name__)

ALIGN = 512  # slot alignment in bytes: every dtype fits, and DMA likes it


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the slot alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class HostPool:
    """A growable-only host buffer; pinned when the parked device is CUDA.

    :param pin: pin the buffer (page-locked) so device copies are asynchronous and at
        full bandwidth. Defaults to True when CUDA is available.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self.allocations = 0
        self.setup_seconds = 0.0  # total time spent allocating (off the switch path)
        self._lock = threading.Lock()
        self._pending: threading.Thread | None = None

    @property
    def capacity(self) -> int:
        """Bytes the pool holds now."""
        return self.buffer.numel()

    def reserve(self, nbytes: int) -> float:
        """Make sure the pool holds at least ``nbytes``; returns seconds spent allocating.

        Growing replaces the buffer (the old one is released): call it only while
        nothing is parked in the pool.
        """
        self.wait()
        return self._grow(nbytes)

    def reserve_async(self, nbytes: int) -> None:
        """Start :meth:`reserve` on a background thread; the next park waits for it."""
        self.wait()
        thread = threading.Thread(target=self._grow, args=(nbytes,), name="rota-host-pool", daemon=True)
        self._pending = thread
        thread.start()

    def wait(self) -> None:
        """Block until a background reservation (if any) has finished."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A uint8 view of ``nbytes`` of the pool at ``offset``."""
        return self.buffer[offset:offset + nbytes]

    def _grow(self, nbytes: int) -> float:
        with self._lock:
            if nbytes <= self.capacity:
                return 0.0
            t0 = time.perf_counter()
            size = align(nbytes)
            self.buffer = torch.empty(0, dtype=torch.uint8)  # drop the old one first: peak memory
            self.buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
            seconds = time.perf_counter() - t0
            self.setup_seconds += seconds
            log.info("host pool: allocated %.3f GB%s in %.3f s (allocation #%d)", size / 1e9,
                     " pinned" if self.pin else "", seconds, self.allocations)
            return seconds

    def __repr__(self) -> str:
        return f"HostPool(capacity={self.capacity}, pinned={self.pin}, allocations={self.allocations})"
