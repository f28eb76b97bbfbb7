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

from collections.abc import Sequence

from rota import ParkResult
from rota.tensors import overlap
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


def switch(park: Tracked | Sequence[Tracked] = (), restore: Tracked | Sequence[Tracked] = ()
           ) -> tuple[ParkResult, ParkResult]:
    """Park ``park`` while restoring ``restore`` in this process, overlapped on two streams.

    For tenants that share one process (benchmarks, the demo's in-process mode);
    tenants in separate processes overlap on their own. Both sides must be between
    turns; the device needs room for both while the switch runs. Returns
    (park result, restore result), each carrying the wall time of the whole switch.
    """
    outs = [park] if isinstance(park, Tracked) else list(park)
    ins = [restore] if isinstance(restore, Tracked) else list(restore)
    specs = []
    for t in outs:
        tags, drop = t._park_args(None)
        t._reshard()
        specs.append((t.parker, tags, drop))
    return overlap(specs, [t.parker for t in ins])
