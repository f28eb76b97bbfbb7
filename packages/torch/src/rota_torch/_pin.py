"""Pinned host chunks for the host pool, made fast and in order.

Why: ``torch.empty(pin_memory=True)`` (``cudaHostAlloc``) pinned 0.84 GB/s on an H200 host, one chunk at a
time (a 20 GB pool took 24 s), so a tenant whose first turn was shorter than that waited at its first
park. Faulting an anonymous mapping in from several threads (with transparent huge pages where the
kernel offers them, ``madvise``) and then registering it (``cudaHostRegister``) pinned 15 GB/s on the same
host (20-28 GB/s in ``bench/switch.py``'s first parks at 49a8a30), and copies to and from it run at the same
bandwidth (``bench/pin_rate.py``). The pages are faulted in by writes from those threads (torch lets go of the GIL
for them, so the threads run in parallel and the tenant's own thread runs meanwhile). Having the kernel fault them
in instead (``MADV_POPULATE_WRITE``, through ctypes: ``mmap.madvise`` holds the GIL) pinned only 4.8-6.3 GB/s on
the same host at f4af044, a quarter of the writes' rate. The kernel zeroes every page it faults in, so one write
per page (``touch``, the default) faults the same pages with half the host memory traffic of writing zeros over
every byte again (``zero``, what the figures above used): 31 GB/s against 27.7 in ``bench/switch.py``'s 20 GB
first park on the H200 host (c9fc3b5 and 49a8a30); ``bench/pin_rate.py`` measures both.

:class:`ChunkMaker` makes the chunks of one reservation on ``ROTA_PIN_THREADS`` threads (default: up to 8)
and hands them out in offset order as soon as each is ready, so a park can copy into the first chunks while
the later ones are still being pinned. Where registration fails (no CUDA, a locked-memory limit), it falls
back to ``cudaHostAlloc`` once and says so.

Registered memory must be unregistered before it is unmapped: :func:`release` does it for the chunks a pool
made; the pool calls it when it is collected (not at interpreter exit, when the driver frees it anyway).

Environment (checked where read):
    ROTA_PIN_THREADS   threads that pin one reservation (default min(8, CPUs); 1 = one at a time)
    ROTA_PIN_METHOD    register (default) or hostalloc (torch's pin_memory=True, one chunk at a time)
    ROTA_PIN_FAULT     how ``register`` faults pages in: touch (default: one byte per page) or zero (every byte)
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
from collections.abc import Callable, Iterator

import torch

from rota.config import env_int
from rota.errors import ConfigError

log = logging.getLogger(__name__)

METHODS = ("register", "hostalloc")
FAULTS = ("touch", "zero")
PAGE = 4096  # a write per base page faults it in (a transparent huge page takes its first write)
_fallback_logged = False


def pin_threads() -> int:
    """``ROTA_PIN_THREADS``, checked (default: up to 8 of this host's CPUs)."""
    return env_int("ROTA_PIN_THREADS", max(1, min(8, os.cpu_count() or 1)), minimum=1)


def pin_fault() -> str:
    """``ROTA_PIN_FAULT``, checked."""
    fault = os.environ.get("ROTA_PIN_FAULT", "touch").strip() or "touch"
    if fault not in FAULTS:
        raise ConfigError(f"ROTA_PIN_FAULT={fault!r} is not understood; use one of {', '.join(FAULTS)}")
    return fault


def pin_method() -> str:
    """``ROTA_PIN_METHOD``, checked."""
    method = os.environ.get("ROTA_PIN_METHOD", "register").strip() or "register"
    if method not in METHODS:
        raise ConfigError(f"ROTA_PIN_METHOD={method!r} is not understood; use one of {', '.join(METHODS)}")
    return method


class Registered:
    """Mappings this process registered with CUDA: (address, mapping), unregistered together by :func:`release`."""

    def __init__(self) -> None:
        self.items: list[tuple[int, mmap.mmap]] = []
        self.lock = threading.Lock()


def release(registered: Registered) -> None:
    """Unregister every mapping (the tensors that view them keep them mapped until they are gone)."""
    with registered.lock:
        items, registered.items = registered.items, []
    if not items or not torch.cuda.is_initialized():
        return
    cudart = torch.cuda.cudart()
    for ptr, _mapping in items:
        cudart.cudaHostUnregister(ptr)


def fault_in(chunk: torch.Tensor, fault: str) -> None:
    """Fault every page of a fresh anonymous mapping in, without the GIL: one write per page (``touch``; the
    kernel hands out zeroed pages) or zeros over every byte (``zero``). Either way the chunk reads as zeros."""
    if fault == "touch":
        chunk[::PAGE].fill_(0)
    else:
        chunk.zero_()


def _registered_chunk(size: int, registered: Registered, fault: str,
                      gate: Callable[[], None] | None = None) -> torch.Tensor:
    """An anonymous mapping of ``size`` bytes, faulted in here (huge pages where offered), then registered once
    ``gate`` returns (the pool holds registrations back while a park issues its copies)."""
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: ordinary pages
            pass
    chunk = torch.frombuffer(mapping, dtype=torch.uint8)
    fault_in(chunk, fault)  # registering faulted pages is then quick
    if gate is not None:
        gate()
    err = int(torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), size, 0))
    if err:
        raise OSError(f"cudaHostRegister of {size} bytes failed with CUDA error {err}")
    with registered.lock:
        registered.items.append((chunk.data_ptr(), mapping))
    return chunk


def _hostalloc_chunk(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8, pin_memory=True)


def _pageable_chunk(size: int) -> torch.Tensor:
    return torch.empty(size, dtype=torch.uint8)


class ChunkMaker:
    """Makes host chunks of the given sizes; :meth:`in_order` yields them by index.

    ``gate`` (optional) is called after a chunk's pages are faulted in and before it is registered.
    ``method``: ``register`` (pinned, on worker threads), ``hostalloc`` (pinned by torch, on the caller's
    thread) or ``pageable`` (ordinary memory, for pools of CPU tenants). A failure stops the workers and is
    raised by :meth:`in_order` at that chunk; :meth:`close` (always call it) waits for the workers so that no
    chunk is made after the reservation ended.
    """

    def __init__(self, sizes: list[int], registered: Registered, *, threads: int | None = None,
                 method: str | None = None, gate: Callable[[], None] | None = None) -> None:
        self.sizes = sizes
        self.registered = registered
        self.gate = gate
        self.method = method or pin_method()
        self.fault = pin_fault() if self.method == "register" else "zero"
        self.threads = max(1, min(threads or pin_threads(), len(sizes)))
        self._done: dict[int, torch.Tensor | BaseException] = {}
        self._next = 0  # the next index a worker takes (ascending: the pool fills from its start)
        self._stop = False
        self._cond = threading.Condition()
        self._workers = [threading.Thread(target=self._work, name=f"rota-pin-{i}", daemon=True)
                         for i in range(self.threads if self.method == "register" else 0)]
        for w in self._workers:
            w.start()

    def _make(self, size: int) -> torch.Tensor:
        global _fallback_logged
        if self.method == "pageable":
            return _pageable_chunk(size)
        if self.method == "register":
            try:
                return _registered_chunk(size, self.registered, self.fault, self.gate)
            except (OSError, RuntimeError) as exc:
                if not _fallback_logged:
                    _fallback_logged = True
                    log.warning("host pool: registering pinned memory failed (%s); pinning with cudaHostAlloc "
                                "instead, one chunk at a time (slower: set ROTA_PIN_METHOD=hostalloc to skip "
                                "the attempt)", exc)
        return _hostalloc_chunk(size)

    def _work(self) -> None:
        while True:
            with self._cond:
                if self._stop or self._next >= len(self.sizes):
                    return
                i = self._next
                self._next += 1
            try:
                out: torch.Tensor | BaseException = self._make(self.sizes[i])
            except BaseException as exc:  # raised again, in order, by in_order()
                out = exc
            with self._cond:
                self._done[i] = out
                if isinstance(out, BaseException):
                    self._stop = True
                self._cond.notify_all()

    def in_order(self) -> Iterator[torch.Tensor]:
        """Each chunk as soon as it and every chunk before it are ready."""
        for i, size in enumerate(self.sizes):
            if not self._workers:  # hostalloc or pageable: on this thread
                yield self._make(size)
                continue
            with self._cond:
                while i not in self._done:
                    self._cond.wait()
                out = self._done.pop(i)
            if isinstance(out, BaseException):
                raise out
            yield out

    def close(self) -> None:
        with self._cond:
            self._stop = True
        for w in self._workers:
            w.join()


__all__ = ["FAULTS", "METHODS", "ChunkMaker", "Registered", "fault_in", "pin_fault", "pin_method", "pin_threads",
           "release"]
