"""Errors of :class:`rota_torch.Tracked`, raised by every torch adapter's ``track()`` and park.

Each carries the tenant and group (``job_id``/``group_id``) like every rota error, so
the client reports it against the right job.
"""

from __future__ import annotations

from rota.errors import InvalidArgument, TransientError

__all__ = ["AlreadyTracked", "BackwardInFlight", "DeviceMismatch", "HoldsTurn", "TrackingError"]


class TrackingError(InvalidArgument):
    """``track`` was called with inputs rota cannot park safely."""


class DeviceMismatch(TrackingError):
    """The model is not on the tenant's device, or its tensors span several devices."""


class AlreadyTracked(TrackingError):
    """The model (or one of its parameters) is already tracked."""


class HoldsTurn(InvalidArgument):
    """Park was asked while the tenant holds its turn."""


class BackwardInFlight(TransientError):
    """Park was asked while a backward pass through the tracked model runs; retry after it."""
