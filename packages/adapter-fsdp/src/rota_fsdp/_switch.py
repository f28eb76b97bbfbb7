"""Overlapped switch between tenants that share one process (benchmarks, in-process demos)."""

from __future__ import annotations

from collections.abc import Sequence

from rota import ParkResult
from rota.tensors import overlap
from rota_fsdp._tracked import Tracked


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
