"""The trainer → sampler weight push: one shared host buffer per job, no serialisation.

Why: pushing a state dict as ``torch.save`` bytes through a pipe made about five transient
host copies of the weights per push (CPU copies, the BytesIO, ``getvalue``, ``recv_bytes``,
``torch.load``), and 20 GB tenants were OOM-killed on a 128 GiB host. Here the runner
creates one anonymous shared file (``memfd``, so a small ``/dev/shm`` does not limit it)
per job, sized for that job's weights, and passes it to both processes. The trainer copies
each tensor straight from the device into its slice of the buffer and sends only a version
number over the pipe; the sampler copies the slices into its own parameters in place.

On CUDA each worker page-locks its mapping of the buffer (``cudaHostRegister``, during
setup, before the clock starts): the copies then run at DMA speed, asynchronously with
one synchronisation per push, and no turn pays for faulting the buffer's pages in. If
the driver refuses (no CUDA, a locked-memory limit), the copies stay pageable and
:attr:`WeightPush.pinned` says so.

Race-freedom: a semaphore holds one "buffer free" token. The trainer takes it *before* its
turn (never while holding the device, or a sampler that needs a turn to read would
deadlock it), writes, and sends the version; the sampler gives the token back once its
parameters hold the copy. So an SFT trainer, which pushes asynchronously, never
overwrites a push its sampler is still reading.

Used by :mod:`rota_demo.runner` (creates one per job) and :mod:`rota_demo.worker`.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import threading
from typing import Any

__all__ = ["ALIGN", "WeightPush", "aligned", "push_bytes", "travel_dtype", "weights_digest"]

ALIGN = 64  # every slice starts on a 64-byte boundary: any dtype view fits, DMA likes it


def aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the slice alignment."""
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class WeightPush:
    """One job's push buffer and its "free" token; pickled into both workers when they start.

    :param nbytes: buffer size; at least the aligned sum of the state dict's tensor sizes.
    :param free: a ``multiprocessing`` semaphore of value 1 from the workers' start context.
    :param dtype: torch dtype name the floating-point tensors travel in (e.g. ``"bfloat16"`` to an engine that
        holds bf16 weights: rounded once, at the trainer's copy, as the engine's own load would); None: each
        tensor's own.
    """

    def __init__(self, nbytes: int, free: Any, fd: int, dtype: str | None = None) -> None:
        self.nbytes, self._free, self._fd, self.dtype = nbytes, free, fd, dtype
        self._map: mmap.mmap | None = None
        self._buffer: Any = None  # uint8 tensor over the mapping, made on first use in the worker
        self._views: dict[str, Any] = {}
        self.pinned = False  # this process's mapping is page-locked for CUDA copies
        self._device: Any = None  # the CUDA device the copies go to or come from (None: host copies)
        self._map_lock = threading.Lock()

    @classmethod
    def create(cls, ctx: Any, nbytes: int, dtype: str | None = None) -> WeightPush:
        """A new buffer (pages are committed only when first written) in the runner process."""
        if nbytes <= 0:
            raise ValueError(f"push buffer size {nbytes} must be > 0")
        fd = os.memfd_create("rota-demo-push", os.MFD_CLOEXEC)
        os.ftruncate(fd, nbytes)
        return cls(nbytes, ctx.Semaphore(1), fd, dtype)

    def close(self) -> None:
        """Drop this process's handle; the memory goes when the last worker mapping it exits."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        from multiprocessing import reduction

        return _rebuild, (reduction.DupFd(self._fd), self.nbytes, self._free, self.dtype)

    # ----------------------------------------------------------------- both ends

    def bind(self, model: Any) -> None:
        """Map the buffer and lay the model's state dict out in it, in order.

        Trainer and sampler build the same model, so both compute the same layout.
        """
        self._mapped()
        offset = 0
        for name, t in model.state_dict().items():
            dtype = travel_dtype(t.dtype, self.dtype)
            n = t.numel() * dtype.itemsize
            if offset + n > self.nbytes:
                raise ValueError(f"push buffer of {self.nbytes} bytes is too small for the state dict "
                                 f"(at {name!r}, {offset + n} bytes needed so far); size it with push_bytes()")
            self._views[name] = self._buffer[offset:offset + n].view(dtype).view(t.shape)
            offset = aligned(offset + n)
            if t.device.type == "cuda":
                self._device = t.device

    def _mapped(self) -> Any:
        """This process's mapping of the buffer as a uint8 tensor, made on first use (once, whichever thread asks:
        a worker pins in a thread of its own while it builds)."""
        import torch

        with self._map_lock:
            if self._buffer is None:
                if self._fd < 0:
                    raise ValueError("push buffer: this handle was closed before it was mapped; map it in a worker "
                                     "that received the buffer, or before close()")
                self._map = mmap.mmap(self._fd, self.nbytes)
                self.close()
                self._buffer = torch.frombuffer(self._map, dtype=torch.uint8)
            return self._buffer

    def pin(self, device: Any = None) -> float:
        """Page-lock this process's mapping for CUDA copies; returns seconds spent (0 when already pinned).

        Faults every page in, so call it during setup: after :meth:`bind` (the copies' device is the model's),
        or before it given ``device``, a CUDA device whose context this process already made (a worker pins in a
        thread while it builds: seconds of page faults off the set-up's critical path). A refusal is not an
        error: the copies stay pageable (slower) and :attr:`pinned` stays False.
        """
        import time

        import torch

        if device is not None and self._device is None and str(device).startswith("cuda"):
            self._mapped()
            self._device = torch.device(device)
        if self._device is None or self.pinned or self._buffer is None:
            return 0.0
        t0 = time.perf_counter()
        rc = torch.cuda.cudart().cudaHostRegister(self._buffer.data_ptr(), self.nbytes, 0)
        self.pinned = int(rc) == 0
        return time.perf_counter() - t0

    def _sync(self, model: Any) -> None:
        if self.pinned:  # the model's device now: in a group over several GPUs it may have moved since bind()
            import torch

            torch.cuda.synchronize(next(model.parameters()).device)

    # ------------------------------------------------------------------- trainer

    def claim(self) -> None:
        """Wait until the sampler has read the previous push. Call *outside* the device turn."""
        self._free.acquire()

    def write(self, model: Any) -> None:
        """Copy every state-dict tensor into the buffer (device → shared host, no other copy).

        Call inside the turn, after :meth:`claim`; then send the version number.
        """
        import torch

        with torch.no_grad():
            for name, t in model.state_dict().items():
                self._views[name].copy_(t, non_blocking=self.pinned)
        self._sync(model)

    # ------------------------------------------------------------------- sampler

    def read_into(self, model: Any) -> None:
        """Copy the buffer into the model's own tensors in place, then free the buffer for the next push.

        Call inside the turn, after the version number arrived.
        """
        import torch

        with torch.no_grad():
            for name, t in model.state_dict().items():
                t.copy_(self._views[name], non_blocking=self.pinned)
        self._sync(model)
        self._free.release()


    def read_with(self, load: Any) -> None:
        """``load(named)`` with the buffer's ``(name, host tensor)`` views (an engine that copies them itself,
        e.g. ``TrackedLLM.update_weights``), then free the buffer for the next push. Call inside the turn."""
        load(list(self._views.items()))
        self._free.release()


def push_bytes(shapes: list[tuple[int, int]]) -> int:
    """Buffer bytes for tensors of ``(numel, element_size)``, laid out as :meth:`WeightPush.bind` does."""
    return sum(aligned(n * e) for n, e in shapes)


def travel_dtype(own: Any, push_dtype: str | None) -> Any:
    """The dtype a tensor of dtype ``own`` has in a buffer whose push dtype is ``push_dtype`` (floating point
    only: integer buffers travel as they are)."""
    import torch

    if push_dtype is None or not own.is_floating_point:
        return own
    return getattr(torch, push_dtype)


def weights_digest(tensors: dict[str, Any]) -> str:
    """sha256 over names and raw bytes, in order; equal digests mean byte-identical weights."""
    import torch

    h = hashlib.sha256()
    for name, t in tensors.items():
        h.update(name.encode())
        copy = t.detach().to("cpu", copy=True).contiguous()  # a copy: numpy() pins its storage's size, and
        h.update(copy.reshape(-1).view(torch.uint8).numpy())  # the parker must be able to resize the original
    return h.hexdigest()


def _rebuild(dupfd: Any, nbytes: int, free: Any, dtype: str | None) -> WeightPush:
    return WeightPush(nbytes, free, dupfd.detach(), dtype)
