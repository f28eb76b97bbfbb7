"""overlap(): one switch that parks the outgoing tenants while it restores the incoming ones.

Who calls it: :func:`rota_torch.switch` (tenants that share one process: benchmarks, the demo's in-process mode;
``rota_fsdp.switch`` is the same function) and ``bench/switch.py``. It drives the steps of
:class:`rota_torch.TensorParker`'s park and restore itself, interleaved, so every copy is in flight before the first
wait.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from rota.types import ParkResult
from rota_torch._parker import TensorParker

__all__ = ["ParkSpec", "overlap"]

ParkSpec = TensorParker | tuple[TensorParker, Iterable[str] | None, Iterable[str]]


def overlap(park: Sequence[ParkSpec] | TensorParker = (),
            restore: Sequence[TensorParker] | TensorParker = ()) -> tuple[ParkResult, ParkResult]:
    """Park ``park`` while restoring ``restore``, each parker on its own stream.

    ``park`` items are parkers (park every tag) or ``(parker, tags, discard)`` tuples
    with the arguments of :meth:`TensorParker.park`.

    PCIe is full duplex: device-to-host copies of the outgoing tenant and host-to-device
    copies of the incoming one run at the same time. All copies are issued before any
    wait. The device must have room for both while the switch runs (the outgoing
    memory is freed only after its copies finish). Returns (park result, restore
    result); both carry the wall time of the whole switch.
    """
    specs = [park] if isinstance(park, TensorParker) else list(park)
    specs = [(p, None, ()) if isinstance(p, TensorParker) else p for p in specs]
    parks = [p for p, _, _ in specs]
    restores = [restore] if isinstance(restore, TensorParker) else list(restore)
    everyone = parks + restores
    if len({id(p) for p in everyone}) != len(everyone):
        raise ValueError("overlap: a parker appears twice; park and restore distinct parkers")
    t0 = time.perf_counter()
    for p in everyone:
        p._lock.acquire()
    try:
        # Allocate first: a device allocation would otherwise wait for the copies in flight.
        jobs_in = [p._alloc_restore() for p in restores]
        jobs_out = [p._begin_park(tags, discard) for p, tags, discard in specs]
        jobs_in = [p._issue_restore(j) for p, j in zip(restores, jobs_in, strict=True)]
        try:
            into = [p._finish(j) for p, j in zip(restores, jobs_in, strict=True)]  # parks free (and sync) last
        finally:  # a refused restore still lets the outgoing park complete (or time out) on its own
            out = [p._finish(j) for p, j in zip(parks, jobs_out, strict=True)]
    finally:
        for p in everyone:
            p._lock.release()
    seconds = time.perf_counter() - t0
    return _sum(out, seconds), _sum(into, seconds)


def _sum(results: list[ParkResult], seconds: float) -> ParkResult:
    total = ParkResult(seconds=seconds)
    for r in results:
        total.bytes_moved += r.bytes_moved
        for tag, n in r.by_tag.items():
            total.by_tag[tag] = total.by_tag.get(tag, 0) + n
    return total
