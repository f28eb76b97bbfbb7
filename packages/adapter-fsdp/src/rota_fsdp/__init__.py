"""rota_fsdp: park PyTorch models (plain, DDP, FSDP2) between a tenant's turns.

One call makes a training job time-sliceable::

    import rota, rota_fsdp
    gpu = rota.connect()
    tracked = rota_fsdp.track(gpu, model, optimizer)   # weights, grads, optimizer state
    for batch in data:
        with gpu.turn():            # restores parked state first
            train_step(model, optimizer, batch)
        # between turns the orchestrator may park it: device memory is freed

:func:`track` returns an :class:`FsdpTracked`, a :class:`rota_torch.Tracked`: the moving,
guards and errors are :mod:`rota_torch`'s (shared with every torch adapter). Losses are
bit-identical to an unparked run: parking copies raw storage bytes out and back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time they load on first use
    from rota_fsdp._tracked import FsdpTracked, track
    from rota_torch import (
        TAGS,
        AlreadyTracked,
        BackwardInFlight,
        DeviceMismatch,
        HoldsTurn,
        Tracked,
        TrackingError,
        switch,
    )

__all__ = [
    "TAGS",
    "AlreadyTracked",
    "BackwardInFlight",
    "DeviceMismatch",
    "FsdpTracked",
    "HoldsTurn",
    "Tracked",
    "TrackingError",
    "switch",
    "track",
]

_HOME = {name: "rota_torch" for name in __all__} | {"FsdpTracked": "rota_fsdp._tracked", "track": "rota_fsdp._tracked"}
__getattr__ = lazy_getattr(__name__, _HOME)  # torch is imported when the adapter is used, not when `rota` loads it
