"""Test helpers for code that tracks models with a torch adapter (rota_fsdp, rota_megatron, new ones)."""

from __future__ import annotations

import rota
from rota_torch.tracked import tracked_models

__all__ = ["untrack_models_of"]


def untrack_models_of(gpus: list[rota.Gpu]) -> None:
    """Untrack every model tracked on one of ``gpus``, whatever adapter tracked it (test clean-up)."""
    for tracked in tracked_models():
        if any(tracked.gpu is g for g in gpus):
            tracked.untrack()
