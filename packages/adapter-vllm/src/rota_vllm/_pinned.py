"""rota's own weights backup for a vLLM engine: a copy in rota's pinned host pool, then vLLM's level-2 sleep.

Why: vLLM's level-1 sleep backs the weights up into host memory of its own, and measured on an H200 its
sleep took 2.2-2.5x a pinned copy of the same bytes (53x the first time: that memory is allocated then) and
its wake 4.4-4.7x. Here the weights are copied into a :class:`rota_torch.HostPool` reserved (and pinned, in
the background) when the engine is tracked, one copy per storage on a side stream, and the engine then sleeps
at level 2, which frees weights and KV cache alike; a restore wakes the weights (vLLM maps their memory again,
at the same addresses), starts copying them back, wakes the KV cache while the copies run (mapping memory is
the driver's work, not the copy engines'), then waits for them. vLLM itself keeps the model's buffers over a
level-2 sleep (it saves ``named_buffers`` and puts them back on wake), so only the parameters travel here.

These functions run inside each vLLM worker, through ``LLM.collective_rpc``: the stash lives on the worker
object, in the worker's process (in-process with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``; in an engine's worker
processes vLLM sends them by reference, which ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` allows).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from rota_torch import HostPool, align, give_back_workspaces

ATTR = "_rota_weights_stash"


def _storages(model: torch.nn.Module) -> list[torch.UntypedStorage]:
    """The distinct storages behind the model's parameters (tied weights once), in first-seen order."""
    seen: dict[tuple[str, int], torch.UntypedStorage] = {}
    for p in model.parameters():
        s = p.detach().untyped_storage()
        key = (str(s.device), s.data_ptr())
        if s.nbytes() and key not in seen:
            seen[key] = s
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class WeightStash:
    """The parameters of one worker's model and the pool that holds their bytes while the engine sleeps."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.storages = _storages(model)
        if not self.storages:
            raise ValueError("the vLLM model has no parameters to keep")
        self.device = self.storages[0].device
        self.offsets, total = [], 0
        for s in self.storages:
            self.offsets.append(total)
            total += align(s.nbytes())
        self.nbytes = sum(s.nbytes() for s in self.storages)
        self.pool = HostPool(pin=self.device.type == "cuda")
        self.pool.reserve_async(total)  # pinned while the engine serves; the first park copies in as it grows
        self.saved = False
        self._loading: tuple[float, Any] | None = None  # (start, stream) between load_begin and load_end

    def _issue(self, to_host: bool) -> Any:
        """Issue every storage's copy (on a side stream on CUDA, returned; None on CPU, where they are done)."""
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), self.pool.copying():
            for s, offset in zip(self.storages, self.offsets, strict=True):
                n = s.nbytes()
                if to_host and not self.pool.wait_for(offset + n):
                    self.pool.reserve(offset + n)
                self.pool.transfer(_bytes_of(s), offset, to_host=to_host, non_blocking=cuda)
        return stream

    def _finish(self, stream: Any) -> None:
        if stream is not None:
            stream.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(stream)

    def save(self) -> float:
        """Copy every parameter's bytes to the pool (before the level-2 sleep frees them)."""
        t0 = time.perf_counter()
        self._finish(self._issue(to_host=True))
        self.saved = True
        return time.perf_counter() - t0

    def load_begin(self) -> None:
        """Start copying the weights back (after the weights' wake mapped their memory again); the copies run
        while the caller wakes the KV cache, whose mapping is work of the driver's, not of the copy engines."""
        if not self.saved:
            raise RuntimeError("rota_vllm: no weights were saved on this worker; nothing to restore")
        if self._loading is not None:
            raise RuntimeError("rota_vllm: a load is already in flight on this worker")
        now = _storages(self.model)
        if [s.data_ptr() for s in now] != [s.data_ptr() for s in self.storages]:
            raise RuntimeError("rota_vllm: the model's parameters moved while the engine slept (a new "
                               "model was loaded?); park with backup='vllm' or mode='discard'")
        self._loading = (time.perf_counter(), self._issue(to_host=False))

    def load_end(self) -> float:
        """Wait for the copies :meth:`load_begin` started; seconds since it began."""
        if self._loading is None:
            raise RuntimeError("rota_vllm: no load is in flight on this worker")
        t0, stream = self._loading
        self._loading = None
        self._finish(stream)
        self.saved = False
        return time.perf_counter() - t0

    def load(self) -> float:
        """Copy the weights back and wait for them."""
        self.load_begin()
        return self.load_end()

    def copy_back(self) -> float:
        """Copy the pool's bytes into the weights once more and wait; seconds. The pool keeps them after a load,
        so a benchmark can time this copy into memory the restore has just written (``bench/vllm_switch.py``)."""
        t0 = time.perf_counter()
        self._finish(self._issue(to_host=False))
        return time.perf_counter() - t0


def worker_model(worker: Any) -> torch.nn.Module:
    """The worker's model, out of any CUDA-graph wrapper (``get_model`` where the runner has it)."""
    runner = worker.model_runner
    get = getattr(runner, "get_model", None)
    return get() if callable(get) else runner.model


def worker_prepare(worker: Any) -> int:
    """Make this worker's stash (once); the bytes it keeps."""
    stash = getattr(worker, ATTR, None)
    if stash is None:
        stash = WeightStash(worker_model(worker))
        setattr(worker, ATTR, stash)
    return stash.nbytes


def worker_stash(worker: Any) -> WeightStash | None:
    """The worker's stash (its storages, their offsets and the pool), for benchmarks; None until prepared."""
    return getattr(worker, ATTR, None)


def worker_save(worker: Any) -> float:
    return getattr(worker, ATTR).save()


def worker_load(worker: Any) -> float:
    return getattr(worker, ATTR).load()


def worker_load_begin(worker: Any) -> None:
    getattr(worker, ATTR).load_begin()


def worker_load_end(worker: Any) -> float:
    return getattr(worker, ATTR).load_end()


def worker_trim(worker: Any) -> None:
    """After the sleep: hand cuBLAS's cached workspaces and the free segments of torch's own allocator (vLLM's
    buffers outside its sleep pool) back to the driver, so the parked engine keeps little beyond its context."""
    device = getattr(worker, "device", None)
    if isinstance(device, torch.device) and device.type == "cuda":
        give_back_workspaces(device)


def worker_release(worker: Any) -> None:
    """Drop the stash and its pool (untrack)."""
    if hasattr(worker, ATTR):
        delattr(worker, ATTR)
