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

import bisect
import logging
import threading
import time

import torch

log = logging.getLogger(__name__)

ALIGN = 512  # slot alignment in bytes: every dtype fits, and DMA likes it


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the slot alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


CHUNK = 1 << 30  # pinning holds the GIL: pin 1 GiB at a time so heartbeats keep flowing


class HostPool:
    """A growable-only host buffer, made of chunks; pinned when the parked device is CUDA.

    Logically one contiguous byte range ``[0, capacity)``; physically chunks of
    ``chunk_bytes`` (allocating 20 GB pinned in one call held the GIL for 15 s and
    starved the tenant's heartbeats). A slot may span two chunks:
    :meth:`pieces` returns one view per chunk it touches.

    :param pin: pin the buffer (page-locked) so device copies are asynchronous and at
        full bandwidth. Defaults to True when CUDA is available.
    :param chunk_bytes: bytes per chunk.
    """

    def __init__(self, *, pin: bool | None = None, chunk_bytes: int = CHUNK) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.chunk_bytes = chunk_bytes
        self.chunks: list[torch.Tensor] = []
        self._starts: list[int] = []  # byte offset of each chunk
        self.allocations = 0  # reserve/grow operations that allocated (each may add several chunks)
        self.setup_seconds = 0.0  # total time spent allocating (off the switch path)
        self._lock = threading.Lock()
        self._pending: threading.Thread | None = None

    @property
    def capacity(self) -> int:
        """Bytes the pool holds now."""
        return sum(c.numel() for c in self.chunks)

    def reserve(self, nbytes: int) -> float:
        """Make sure the pool holds at least ``nbytes``; returns seconds spent allocating.

        Growing appends chunks; bytes already in the pool stay where they are.
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

    def pieces(self, offset: int, nbytes: int) -> list[torch.Tensor]:
        """uint8 views covering ``nbytes`` at ``offset``, one per chunk touched, in order."""
        out = []
        end = offset + nbytes
        i = max(bisect.bisect_right(self._starts, offset) - 1, 0)
        while i < len(self.chunks) and self._starts[i] < end:
            c, base = self.chunks[i], self._starts[i]
            lo, hi = max(offset, base), min(end, base + c.numel())
            if lo < hi:
                out.append(c[lo - base:hi - base])
            i += 1
        if sum(p.numel() for p in out) != nbytes:
            raise ValueError(f"host pool: [{offset}, {end}) is beyond its capacity {self.capacity}")
        return out

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A single uint8 view of ``nbytes`` at ``offset`` (a copy if it spans chunks)."""
        parts = self.pieces(offset, nbytes)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _grow(self, nbytes: int) -> float:
        with self._lock:
            missing = nbytes - self.capacity
            if missing <= 0:
                return 0.0
            t0 = time.perf_counter()
            missing = align(missing)
            while missing > 0:
                size = min(self.chunk_bytes, missing)
                self._starts.append(self.capacity)
                self.chunks.append(torch.empty(size, dtype=torch.uint8, pin_memory=self.pin))
                missing -= size
                time.sleep(0)  # let other threads (heartbeats) take the GIL between chunks
            self.allocations += 1
            seconds = time.perf_counter() - t0
            self.setup_seconds += seconds
            log.info("host pool: grown to %.3f GB%s in %.3f s (allocation #%d)", self.capacity / 1e9,
                     " pinned" if self.pin else "", seconds, self.allocations)
            return seconds

    def __repr__(self) -> str:
        return (f"HostPool(capacity={self.capacity}, chunks={len(self.chunks)}, pinned={self.pin}, "
                f"allocations={self.allocations})")
