"""rota_megatron: park Megatron-Core trainers (model chunks, DDP buffers, optimizer) between turns.

One call makes a Megatron-Core training job time-sliceable::

    import rota, rota_megatron
    gpu = rota.connect()
    model = get_model(...)                               # list of chunks (virtual pipeline)
    optimizer = get_megatron_optimizer(config, model)    # DistributedOptimizer too
    tracked = rota_megatron.track(gpu, model, optimizer)
    for batch in data:
        with gpu.turn():                                 # restores parked state first
            train_step(model, optimizer, batch)

Each rank parks its own tensors (its DDP buffers and its optimizer shard); process
groups stay alive. :class:`MegatronTracked` is a :class:`rota_torch.Tracked`: the moving,
guards, hooks, errors and ``track`` knobs are :mod:`rota_torch`'s, the same as every torch
adapter's (see :mod:`rota_megatron._tracked` for what is parked).
Importing checks the installed megatron-core version (:func:`check_megatron`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr
from rota_megatron._compat import PIP_FIX, SUPPORTED, MegatronVersionError, check_megatron

MEGATRON_VERSION = check_megatron()  # reads package metadata only: cheap, and fails early with the fix

if TYPE_CHECKING:  # at run time these load on first use, so `rota` starts without torch/megatron
    from rota_megatron._tracked import MegatronTracked, ddp_buffers, leaf_optimizers, track
    from rota_torch import TAGS, AlreadyTracked, BackwardInFlight, DeviceMismatch, HoldsTurn, TrackingError

_HOME = {name: "rota_torch" for name in ("TAGS", "AlreadyTracked", "BackwardInFlight", "DeviceMismatch",
                                         "HoldsTurn", "TrackingError")}
_HOME |= {name: "rota_megatron._tracked" for name in ("MegatronTracked", "ddp_buffers", "leaf_optimizers",
                                                      "track")}

__getattr__ = lazy_getattr(__name__, _HOME)

__all__ = [
    "MEGATRON_VERSION",
    "PIP_FIX",
    "SUPPORTED",
    "TAGS",
    "AlreadyTracked",
    "BackwardInFlight",
    "DeviceMismatch",
    "HoldsTurn",
    "MegatronTracked",
    "MegatronVersionError",
    "TrackingError",
    "check_megatron",
    "ddp_buffers",
    "leaf_optimizers",
    "track",
]
