"""cpu_shim: run Megatron-Core's GPU-only code paths on a CPU-only torch, for tests only.

Why it exists: rota's CI has no GPU, yet the adapter must be shown to park Megatron
DDP's contiguous param/grad buffers and the DistributedOptimizer's fp32 shards
bit-identically. Megatron-Core 0.16 hard-codes CUDA in a few places that have nothing
to do with what is parked:

* ``torch.cuda.current_device()`` as the device of DDP's buffers and of new tensors;
* ``torch.tensor(..., device='cuda')`` literals (``_dummy_overflow_buf``, grad-norm
  scratch in ``clip_grads``, ``get_default_causal_mask``);
* ``param.type() == 'torch.cuda.FloatTensor'`` checks in the DistributedOptimizer;
* the CUDA RNG tracker (``get_cuda_rng_tracker().fork()`` around attention dropout).

:func:`install` redirects each of these to the CPU: ``current_device`` answers
``"cpu"``, a :class:`~torch.overrides.TorchFunctionMode` rewrites ``device='cuda'`` to
``'cpu'`` and reports CPU tensors' ``type()`` as their ``torch.cuda.*`` names, and the
RNG tracker's ``fork`` becomes a no-op (tests run with dropout 0). Megatron's numerics
are untouched. Never install it in a process that has a GPU: it is a test harness,
which is why it refuses when CUDA is available.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)

_installed: list[TorchFunctionMode] = []


class _CudaToCpu(TorchFunctionMode):
    """Rewrites ``device='cuda'`` to CPU and answers ``Tensor.type()`` with CUDA type names."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name.replace("torch.", "torch.cuda.", 1) if ".cuda." not in name else name
        return func(*args, **kwargs)


def _no_fork(self: object, name: str = "model-parallel-rng") -> contextlib.AbstractContextManager[None]:
    @contextlib.contextmanager
    def nothing() -> Iterator[None]:
        yield

    return nothing()


def install() -> None:
    """Make Megatron-Core's CUDA-only calls run on CPU in this process (idempotent; tests only).

    :raises RuntimeError: CUDA is available (the shim would hide real device bugs).
    """
    if _installed:
        return
    if torch.cuda.is_available():
        raise RuntimeError("rota_megatron.cpu_shim is for CPU-only test processes; this one has CUDA")
    from megatron.core.tensor_parallel import random as megatron_random

    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment,return-value]
    megatron_random.CudaRNGStatesTracker.fork = _no_fork  # type: ignore[method-assign,assignment]
    mode = _CudaToCpu()
    mode.__enter__()
    _installed.append(mode)
    log.warning("rota_megatron.cpu_shim installed: Megatron-Core's CUDA calls are redirected to the CPU (tests only)")
