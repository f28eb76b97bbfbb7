"""Helpers for tests of rota and of plugins: a real orchestrator on loopback.

Public on purpose: adapter packages use :func:`running_orchestrator` to test against
the embedded orchestrator over real gRPC, in a thread of the test process.
"""

import contextlib
from collections.abc import Callable, Iterator

import rota
from rota._client import Gpu
from rota._engine import OrchestratorConfig
from rota._inproc import free_port, running_orchestrator

__all__ = ["free_port", "quick_config", "running_orchestrator", "tenants"]


@contextlib.contextmanager
def tenants(endpoint: str, *, before_close: Callable[[list[Gpu]], None] | None = None
            ) -> Iterator[Callable[..., Gpu]]:
    """Yield ``connect(tenant, group="g") -> Gpu`` for ``endpoint``; every Gpu it made is
    closed when the block ends (after ``before_close(gpus)``, e.g. to untrack models)."""
    made: list[Gpu] = []

    def connect(tenant: str, group: str = "g") -> Gpu:
        gpu = rota.connect(group=group, tenant=tenant, endpoint=endpoint)
        made.append(gpu)
        return gpu

    try:
        yield connect
    finally:
        if before_close is not None:
            before_close(made)
        for gpu in made:
            gpu.close()


def quick_config() -> OrchestratorConfig:
    """Short TTL and park timeout, so a test that goes wrong fails in seconds."""
    return OrchestratorConfig(ttl_s=5.0, park_timeout_s=30.0)
