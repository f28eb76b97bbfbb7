"""The host pool: one host buffer that parked storages are copied into.

Pinning host memory is slow (a 20 GB pinned buffer took 24 s on an H200 host), and a
pageable destination halves copy bandwidth. So a parker allocates its pool once, ahead
of the first park and ideally in the background (:meth:`HostPool.reserve_async`), and
carves it into slots on every park. The pool only grows, and only when the bytes to
park exceed its capacity; :attr:`HostPool.allocations` counts every allocation so a
test can show that switching allocates nothing.

Host-memory budgets: every pool of this process counts against one budget
(``budget_bytes=`` or ``ROTA_HOST_BUDGET_BYTES``; 0 = none), and every rota process
of the node against the node budget (``ROTA_NODE_HOST_BUDGET_BYTES``, kept in the
node ledger, see :mod:`rota_torch._ledger`). A pool that would grow past
it either spills the missing part to a file in ``spill_dir`` (``ROTA_SPILL_DIR``; a
memory-mapped file, so copies go through the page cache at disk speed, counted in
:attr:`HostPool.spilled_bytes`) or, with no spill directory, raises
:class:`HostBudgetExceeded` naming the numbers and both fixes.

Spill files hold a tenant's parked state and may live in a directory other users can
write (``/tmp``), so a file is never reached by name: it is made without one
(``O_TMPFILE``, else created ``O_EXCL`` and unlinked at once) in the directory opened
without following links, and mapped through its descriptor. The directory must be this
user's, or root's and sticky if others may write it; anything else is refused.

Used by :class:`rota_torch.TensorParker`; thread-safe (a background reservation may
race with the first park, which waits for it).
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import mmap
import os
import secrets
import stat
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import torch

from rota.config import env_bytes
from rota.errors import ConfigError, PermanentError
from rota_torch._ledger import LedgerBusy, locked_ledger, node_budget
from rota_torch._pin import ChunkMaker, Registered, release

log = logging.getLogger(__name__)

ALIGN = 512  # slot alignment in bytes: every dtype fits, and DMA likes it


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to the slot alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class HostBudgetExceeded(PermanentError):
    """Growing a host pool would pass the process's host-memory budget and no spill directory is set."""


_pools: weakref.WeakSet[HostPool] = weakref.WeakSet()  # every live pool: the process-wide account


def host_bytes_in_use() -> tuple[int, int]:
    """(pinned or in-memory bytes, spilled bytes) held by every host pool of this process."""
    pools = list(_pools)
    return sum(p.capacity - p.spilled_bytes for p in pools), sum(p.spilled_bytes for p in pools)


def _check_spill_dir(path: str, source: str) -> str:
    if path:
        os.close(_open_spill_dir(path, source))
    return path


def _open_spill_dir(path: str, source: str) -> int:
    """The spill directory, opened without following a link; refused unless only this user (or root, sticky) may
    replace entries in it."""
    if os.path.islink(path):
        raise ConfigError(f"{source}={path!r} is a symbolic link; point {source} at the directory itself")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        raise ConfigError(f"{source}={path!r} is not a directory; create it or point {source} at one") from None
    st = os.fstat(fd)
    why = ""
    if st.st_uid not in (0, os.geteuid()):
        why = f"is owned by uid {st.st_uid}, who could swap the files in it"
    elif st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        why = f"is writable by others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
    if why:
        os.close(fd)
        raise ConfigError(f"{source}={path!r} {why}; use a directory of your own (mkdir -m 700 DIR)")
    return fd


def _nameless_file(dir_fd: int) -> int:
    """A new file in the directory that no other process can open by name (O_TMPFILE, else O_EXCL + unlink)."""
    try:
        return os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
    name = f"rota-spill-{secrets.token_hex(8)}.bin"  # the filesystem has no O_TMPFILE
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    os.unlink(name, dir_fd=dir_fd)  # only we (or root) may rename in this directory: this is our file
    return fd


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
    :param budget_bytes: host bytes all pools of this process may hold in memory
        (default ``ROTA_HOST_BUDGET_BYTES``; 0 = unlimited).
    :param spill_dir: where chunks past the budget go as memory-mapped files
        (default ``ROTA_SPILL_DIR``; empty = refuse to grow past the budget).
    """

    def __init__(self, *, pin: bool | None = None, chunk_bytes: int = CHUNK, budget_bytes: int | None = None,
                 spill_dir: str | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.chunks: list[torch.Tensor] = []
        self._held = 0  # bytes of the chunks: capacity, read on every copy a park issues
        if chunk_bytes <= 0 or chunk_bytes % ALIGN:  # sampled verify reads the chunks as 8-byte words
            raise ConfigError(f"chunk_bytes={chunk_bytes!r} must be a positive multiple of {ALIGN}")
        self.chunk_bytes = chunk_bytes
        self._starts: list[int] = []  # byte offset of each chunk
        self.allocations = 0  # reserve/grow operations that allocated (each may add several chunks)
        self.setup_seconds = 0.0  # total time spent allocating (off the switch path)
        self._lock = threading.Lock()
        self._pending: threading.Thread | None = None
        if budget_bytes is not None and budget_bytes < 0:
            raise ConfigError(f"budget_bytes={budget_bytes!r} is negative; pass bytes >= 0 (0 = no budget)")
        self.budget_bytes = env_bytes("ROTA_HOST_BUDGET_BYTES", 0) if budget_bytes is None \
            else budget_bytes
        self.node_budget_bytes = node_budget()
        self._spill_source = "ROTA_SPILL_DIR" if spill_dir is None else "spill_dir"
        self.spill_dir = _check_spill_dir(os.environ.get("ROTA_SPILL_DIR", "") if spill_dir is None else spill_dir,
                                          self._spill_source)
        self.spilled_bytes = 0  # part of the capacity that lives in spill files
        self._error: BaseException | None = None
        self._ready = threading.Condition()  # chunks appended, or a reservation ended
        self._target = 0  # capacity the reservation under way will reach (0: none under way)
        self._copying = 0  # callers issuing copies into the pool now (copying()): registrations wait for them
        self.pinned_seconds = 0.0  # time spent pinning, and the bytes pinned: the host's pinning rate
        self.grown_at = 0.0  # time.perf_counter() when the last growth ended (0: never grown)
        self.chunk_ready_at: list[float] = []  # time.perf_counter() when each chunk was added (benchmarks)
        self.pinned_bytes = 0
        self._registered = Registered()  # chunks registered with CUDA, unregistered when the pool goes
        fin = weakref.finalize(self, release, self._registered)
        fin.atexit = False  # at exit the driver frees them with the process
        _pools.add(self)

    @property
    def capacity(self) -> int:
        """Bytes the pool holds now."""
        return self._held

    def reserve(self, nbytes: int) -> float:
        """Make sure the pool holds at least ``nbytes``; returns seconds spent allocating.

        Growing appends chunks; bytes already in the pool stay where they are.
        """
        self.wait()
        with self._registrations_through():  # a copier growing the pool itself must not hold back its pinning
            return self._grow(nbytes)

    def reserve_async(self, nbytes: int) -> None:
        """Start :meth:`reserve` on a background thread; the next park waits for it."""
        self.wait()
        with self._ready:  # from now on a park may wait for these bytes chunk by chunk (wait_for)
            self._target = max(self._target, nbytes)
        thread = threading.Thread(target=self._grow_bg, args=(nbytes,), name="rota-host-pool", daemon=True)
        self._pending = thread
        thread.start()

    def wait(self) -> None:
        """Block until a background reservation (if any) has finished."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.join()
        error, self._error = self._error, None
        if error is not None:
            raise error

    @property
    def target_bytes(self) -> int:
        """What the capacity will be once the reservation under way (if any) ends."""
        with self._ready:
            return max(self._target, self.capacity)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        """Hold back the pinning of the rest of a reservation while the caller issues copies into the pool.

        Why: registering memory with CUDA (``cudaHostRegister``) holds a driver lock that a copy's issue waits
        for; on an H100 host, copies issued while 32 GiB were being registered moved 23 GB/s instead of 55, and
        issuing them took most of that time (``bench/pin_rate.py --copy-while-pinning``), so a first park that
        copied into the chunks already pinned crawled until pinning ended. Copies already issued run on at full
        rate while registration goes on; so registrations wait while the caller issues, and go ahead whenever
        it waits for bytes not yet pinned (:meth:`wait_for`). Faulting pages in never waits.
        """
        with self._ready:
            self._copying += 1
        try:
            yield
        finally:
            with self._ready:
                self._copying -= 1
                self._ready.notify_all()

    @contextlib.contextmanager
    def _registrations_through(self) -> Iterator[None]:
        """While a caller inside :meth:`copying` waits for bytes (or grows the pool itself), the registrations
        that make them go ahead: one copier fewer for the duration (none if the caller is not copying)."""
        with self._ready:
            through = self._copying > 0
            if through:
                self._copying -= 1
                self._ready.notify_all()
        try:
            yield
        finally:
            if through:
                with self._ready:
                    self._copying += 1

    def registration_gate(self, limit_s: float = 1.0) -> None:
        """Called by the pinning threads before each registration: wait (at most ``limit_s``) while a caller
        issues copies (:meth:`copying`)."""
        deadline = time.monotonic() + limit_s
        with self._ready:
            while self._copying and time.monotonic() < deadline:
                self._ready.wait(0.01)

    def wait_for(self, nbytes: int, check: Callable[[], None] | None = None) -> bool:
        """Block until the first ``nbytes`` of the pool are allocated; False if no reservation under way will.

        Why: a park can copy into the chunks already pinned while the rest of a reservation is still being
        pinned (the first park after ``track``). ``check`` runs while waiting (a park's deadline).
        A background reservation that failed raises its error here.
        """
        if self._held >= nbytes:  # the common case, every run of every park: no lock
            return True
        with self._ready, self._registrations_through():
            while self.capacity < nbytes and self._target >= nbytes and self._error is None:
                self._ready.wait(0.05)
                if check is not None:
                    check()
            ready = self.capacity >= nbytes
        if not ready and (self._error is not None or self._pending is not None):
            # the reservation ended short: join it, so a failure raises here (its thread records the error only
            # after it has lowered the target, which is what ended the loop above)
            self.wait()
            ready = self.capacity >= nbytes
        return ready

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

    def transfer(self, device_bytes: torch.Tensor, offset: int, *, to_host: bool, non_blocking: bool) -> None:
        """Copy the uint8 tensor ``device_bytes`` into the pool at ``offset`` (``to_host``) or the pool's bytes
        there back into it: one copy per chunk the range touches, issued on the current stream."""
        at = 0
        for part in self.pieces(offset, device_bytes.numel()):
            piece = device_bytes[at:at + part.numel()]
            if to_host:
                part.copy_(piece, non_blocking=non_blocking)
            else:
                piece.copy_(part, non_blocking=non_blocking)
            at += part.numel()

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """A single uint8 view of ``nbytes`` at ``offset`` (a copy if it spans chunks)."""
        parts = self.pieces(offset, nbytes)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def gather_words(self, positions: torch.Tensor) -> torch.Tensor:
        """The 8-byte words at sorted absolute word ``positions``, as one int64 tensor: one read per chunk."""
        out = torch.empty(positions.numel(), dtype=torch.int64)
        if positions.numel() == 0:
            return out
        chunks = list(self.chunks)  # a reservation may still be appending: read the chunks made so far
        starts = torch.tensor(self._starts[:len(chunks)], dtype=torch.int64) // 8
        splits = [*torch.searchsorted(positions, starts).tolist(), positions.numel()]
        for i, chunk in enumerate(chunks):
            lo, hi = splits[i], splits[i + 1]
            if lo < hi:
                torch.index_select(chunk.view(torch.int64), 0, positions[lo:hi] - int(starts[i]), out=out[lo:hi])
        return out

    def _grow_bg(self, nbytes: int) -> None:
        try:
            self._grow(nbytes)
        except BaseException as exc:  # raised again by the next wait()/wait_for()/park
            log.error("host pool: background reservation of %.3f GB failed: %s", nbytes / 1e9, exc)
            self._error = exc
        finally:
            with self._ready:
                self._target = self.capacity
                self._ready.notify_all()

    def _room(self, others_on_node: int) -> int | None:
        """Bytes this pool may still take in memory under the process and node budgets (None = unlimited)."""
        in_memory, _ = host_bytes_in_use()
        rooms = []
        if self.budget_bytes:
            rooms.append(self.budget_bytes - in_memory)
        if self.node_budget_bytes:
            rooms.append(self.node_budget_bytes - others_on_node - in_memory)
        return max(min(rooms), 0) if rooms else None

    def _plan(self, missing: int) -> int:
        """Bytes of ``missing`` that go in memory (the rest spills); recorded in the node ledger first.

        Check and record happen under this uid's ledger lock so two of its processes
        cannot both take the last of the node budget; other uids' processes are read
        again after the record and the claim shrinks if they grew meanwhile (see
        :mod:`rota_torch._ledger`). The allocation itself happens after.
        """
        if not self.node_budget_bytes:
            planned = self._in_memory_part(missing, 0)
            self._record(host_bytes_in_use()[0] + planned)
            return planned
        with locked_ledger() as ledger:
            others = ledger.others()
            planned = self._in_memory_part(missing, others)
            ledger.record(host_bytes_in_use()[0] + planned)
            later = ledger.others()  # other uids take their own locks: look again now that our claim shows
            if later > others:
                try:
                    planned = self._in_memory_part(missing, later)
                except HostBudgetExceeded:
                    ledger.record(host_bytes_in_use()[0])  # our claim withdrawn
                    raise
                ledger.record(host_bytes_in_use()[0] + planned)
            return planned

    def _in_memory_part(self, missing: int, others_on_node: int) -> int:
        """How much of ``missing`` the budgets leave room for in memory; refuses if none may spill."""
        room = self._room(others_on_node)
        self._check_room(missing, room, others_on_node)
        return missing if room is None else min(missing, room)

    def _check_room(self, missing: int, room: int | None, others_on_node: int) -> None:
        if room is None or missing <= room or self.spill_dir:
            return
        in_memory, _ = host_bytes_in_use()
        node_room = self.node_budget_bytes - others_on_node - in_memory
        # the budget that binds is named (the room is clamped at 0, so compare the budgets, not the room)
        if self.node_budget_bytes and (not self.budget_bytes or node_room <= self.budget_bytes - in_memory):
            raise HostBudgetExceeded(
                f"host pool: parking needs {missing / 1e9:.3f} GB more host memory but the node budget "
                f"(ROTA_NODE_HOST_BUDGET_BYTES) is {self.node_budget_bytes / 1e9:.3f} GB, other rota processes on "
                f"this node hold {others_on_node / 1e9:.3f} GB and this one {in_memory / 1e9:.3f} GB; wait for a "
                "tenant to leave, raise the node budget, or set ROTA_SPILL_DIR to spill parked state to disk")
        raise HostBudgetExceeded(
            f"host pool: parking needs {missing / 1e9:.3f} GB more host memory but the budget is "
            f"{self.budget_bytes / 1e9:.3f} GB and {in_memory / 1e9:.3f} GB is in use; raise "
            "ROTA_HOST_BUDGET_BYTES, or set ROTA_SPILL_DIR to spill parked state to disk")

    def _record(self, nbytes: int) -> None:
        """Best effort without a node budget: the ledger is for accounting, not enforcement, then."""
        try:
            with locked_ledger() as ledger:
                ledger.record(nbytes)
        except (ConfigError, LedgerBusy, OSError) as exc:
            if self.node_budget_bytes:
                raise
            log.debug("host pool: node ledger not updated: %s", exc)

    def _spill_chunk(self, size: int) -> torch.Tensor:
        dir_fd = _open_spill_dir(self.spill_dir, self._spill_source)  # checked again: it may have changed since
        try:
            fd = _nameless_file(dir_fd)
        finally:
            os.close(dir_fd)
        try:
            os.ftruncate(fd, size)
            mapping = mmap.mmap(fd, size)  # shared, read-write; the tensor keeps it (and so the file) alive
        finally:
            os.close(fd)
        chunk = torch.frombuffer(mapping, dtype=torch.uint8)
        self.spilled_bytes += size
        return chunk

    def _grow(self, nbytes: int) -> float:
        with self._lock:
            missing = nbytes - self.capacity
            if missing <= 0:
                return 0.0
            t0 = time.perf_counter()
            missing = align(missing)
            planned = in_memory = self._plan(missing)
            sizes = []  # (size, spilled): chunks in offset order; the first in-memory ones, then the spill
            while missing > 0:
                size = min(self.chunk_bytes, missing)
                sizes.append((size, size > in_memory))
                in_memory -= 0 if size > in_memory else size
                missing -= size
            made = 0  # in-memory bytes really allocated
            maker = ChunkMaker([n for n, spilled in sizes if not spilled], self._registered,
                               method=None if self.pin else "pageable", gate=self.registration_gate)
            made_chunks = maker.in_order()
            with self._ready:
                self._target = self.capacity + sum(n for n, _ in sizes)
            try:
                for size, spilled in sizes:
                    if spilled:
                        chunk = self._spill_chunk(size)
                        log.warning("host pool: %.3f GB over the host budget spilled to a file in %s (parks and "
                                    "restores of it run at disk speed)", size / 1e9, self.spill_dir)
                    else:
                        chunk = next(made_chunks)
                        made += size
                    with self._ready:  # offsets first: pieces() bounds its walk by the chunks
                        self._starts.append(self.capacity)
                        self.chunks.append(chunk)
                        self._held += chunk.numel()
                        self.chunk_ready_at.append(time.perf_counter())
                        self._ready.notify_all()
                    time.sleep(0)  # let other threads (heartbeats) take the GIL between chunks
            finally:
                maker.close()
                with self._ready:
                    self._target = self.capacity
                    self._ready.notify_all()
                if made < planned:  # an allocation failed: the ledger holds only what was really allocated
                    self._record(host_bytes_in_use()[0])
            self.allocations += 1
            seconds = time.perf_counter() - t0
            self.setup_seconds += seconds
            self.grown_at = t0 + seconds
            self.pinned_seconds += seconds if self.pin else 0.0
            self.pinned_bytes += made if self.pin else 0
            log.info("host pool: grown to %.3f GB%s in %.3f s (allocation #%d)", self.capacity / 1e9,
                     " pinned" if self.pin else "", seconds, self.allocations)
            return seconds

    def __repr__(self) -> str:
        return (f"HostPool(capacity={self.capacity}, chunks={len(self.chunks)}, pinned={self.pin}, "
                f"allocations={self.allocations}, spilled={self.spilled_bytes})")
