"""Test helpers for code that tracks models with rota_fsdp (also used by rota_megatron's tests)."""

from __future__ import annotations

import rota


def untrack_models_of(gpus: list[rota.Gpu]) -> None:
    """Untrack every model tracked on one of ``gpus`` (test clean-up)."""
    from rota_fsdp import _tracked

    for tracked in list(_tracked._models.values()):
        if any(tracked.gpu is g for g in gpus):
            tracked.untrack()
