"""Park backends: one module each, all behind :class:`rota_agent.backends._base.Backend`."""

from __future__ import annotations

from rota_agent.backends._base import Backend, Channel, Job, Moved
from rota_agent.backends.app_channel import AppChannelBackend
from rota_agent.backends.app_endpoint import AppEndpointBackend
from rota_agent.backends.cuda import CudaBackend, CudaDriver, LibCudaDriver
from rota_agent.backends.noop import NoopBackend


def default_backends(*, step_timeout_s: float = 120.0) -> dict[str, Backend]:
    """The backends ``rota agent serve`` offers, by name."""
    return {"app_channel": AppChannelBackend(), "cuda": CudaBackend(step_timeout_s=step_timeout_s),
            "app_endpoint": AppEndpointBackend(timeout_s=step_timeout_s), "noop": NoopBackend()}


__all__ = ["AppChannelBackend", "AppEndpointBackend", "Backend", "Channel", "CudaBackend", "CudaDriver", "Job",
           "LibCudaDriver", "Moved", "NoopBackend", "default_backends"]
