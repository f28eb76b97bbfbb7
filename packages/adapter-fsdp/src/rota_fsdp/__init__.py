"""rota_fsdp: park PyTorch models (plain, DDP, FSDP2) between a tenant's turns.

One call makes a training job time-sliceable::

    import rota, rota_fsdp
    gpu = rota.connect()
    tracked = rota_fsdp.track(gpu, model, optimizer)   # weights, grads, optimizer state
    for batch in data:
        with gpu.turn():            # restores parked state first
            train_step(model, optimizer, batch)
        # between turns the orchestrator may park it: device memory is freed

The moving is done by :mod:`rota.tensors` (shared with other torch adapters). Losses
are bit-identical to an unparked run: parking copies raw storage bytes out and back.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the public names, for type checkers; at run time they load on first use
    from rota_fsdp._switch import switch
    from rota_fsdp._tracked import (
        TAGS,
        AlreadyTracked,
        BackwardInFlight,
        DeviceMismatch,
        HoldsTurn,
        Tracked,
        TrackingError,
        track,
    )

__all__ = [
    "TAGS",
    "AlreadyTracked",
    "BackwardInFlight",
    "DeviceMismatch",
    "HoldsTurn",
    "Tracked",
    "TrackingError",
    "switch",
    "track",
]

_HOME = {name: "rota_fsdp._tracked" for name in __all__} | {"switch": "rota_fsdp._switch"}


def __getattr__(name: str) -> Any:
    """Import torch only when the adapter is used, not when `rota` loads its plugins."""
    if name not in _HOME:
        raise AttributeError(f"module 'rota_fsdp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOME[name]), name)
    globals()[name] = value
    return value
