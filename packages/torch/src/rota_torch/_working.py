"""The ``working`` footprint of a CUDA tenant: the CUDA cache its last turn needed beyond its tracked tensors.

Why: the orchestrator keeps tenants resident while their footprints fit its ``capacity_bytes``, and a footprint
of tracked tensors alone leaves out what a step allocates on top (activations, a bf16 copy of the weights,
workspaces). On an 80 GB H100 three ``rota demo`` LLM trainers of 7, 23 and 32 GB fitted a 71 GiB capacity by
their tracked state and ran out of device memory in a step. With this registered, each tenant reports its last
turn's peak beyond what it tracks, so a tenant whose step needs room gets it (others are parked for it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from rota import hookimpl

__all__ = ["WorkingSet", "counts_cache"]

log = logging.getLogger("rota_torch.working")


class WorkingSet:
    """The ``working`` footprint tag of one tenant: its last turn's peak CUDA cache beyond its tracked tensors.

    Registered on the tenant's plugin manager: ``rota_turn_started`` restarts the allocator's peak, and the
    caller calls :meth:`turn_ended` inside the turn, just before its release (``rota_turn_ended`` comes after
    the release, which already reports the footprint), so ``rota_footprint``, called on every acquire and
    heartbeat, only reads a number. ``peak`` and ``reset`` read and restart the allocator's peak
    (``torch.cuda``'s for ``device`` by default). A turn's own peak is a measurement: one that fails keeps the
    last value and never costs the tenant its turn. While one is registered for a tenant, the tenant keeps its
    CUDA cache between turns (:func:`counts_cache`): the footprint counts it, so the capacity holds room for it.
    """

    def __init__(self, gpu: Any, device: Any, *, peak: Callable[[], int] | None = None,
                 reset: Callable[[], None] | None = None) -> None:
        import torch

        self.gpu, self.bytes = gpu, 0
        # torch.cuda's peak counters raise "Invalid device argument" until this process has used CUDA
        self._peak = peak or (lambda: torch.cuda.max_memory_reserved(device) if torch.cuda.is_initialized() else 0)
        self._reset = reset or (
            lambda: torch.cuda.reset_peak_memory_stats(device) if torch.cuda.is_initialized() else None)
        gpu.pm.register(self, name=f"rota-torch-working-set-{id(self)}")

    @hookimpl
    def rota_turn_started(self, tenant: Any, grant: Any) -> None:
        if tenant is not self.gpu:
            return
        try:
            self._reset()
        except Exception as e:  # a measurement must never cost the tenant its turn
            log.warning("working set: could not reset the allocator's peak: %s", e)

    def turn_ended(self) -> dict[str, int] | None:
        """Measure the turn that is ending: its peak beyond what the tenant tracks. Returns the tenant's footprint
        as it now reports it (its tracked tags and this working set), which a caller that records it need not read
        again; None when the measurement failed."""
        try:
            tags = {k: v for k, v in self.gpu.footprint().items() if k != "working"}
            self.bytes = max(0, self._peak() - sum(tags.values()))
        except Exception as e:
            log.warning("working set: could not read the allocator's peak (keeping %d bytes): %s", self.bytes, e)
            return None
        return {**tags, "working": self.bytes}

    @hookimpl
    def rota_footprint(self, tenant: Any) -> dict[str, int] | None:
        return {"working": self.bytes} if tenant is self.gpu else None


def counts_cache(gpu: Any) -> bool:
    """Whether ``gpu``'s footprint counts its CUDA cache: a :class:`WorkingSet` of that tenant is registered.

    Why: its last turn's peak cache is part of the footprint the orchestrator fits into ``capacity_bytes``, so the
    cache it still holds (at most that peak: a turn's peak starts at what is already reserved) takes no room the
    orchestrator would give anyone else, and returning it to the driver at the turn's end only makes the next turn
    map it again. Several tenants may share one process's plugin manager: only this tenant's working set counts.
    """
    return any(isinstance(p, WorkingSet) and p.gpu is gpu for p in gpu.pm.get_plugins())
