"""pytest fixtures for testing a plugin against a real orchestrator: ``endpoint`` and ``connect``.

A pytest plugin: rota-core registers it under the ``pytest11`` entry points, so every pytest run
where rota-core is installed has these fixtures; a test names them and imports nothing. The
other packages' fixtures come the same way: ``torch_connect`` (rota_torch), ``fake_vllm`` and
``fake_sglang`` (rota_serving), ``fake_api`` and ``core_api`` (rota_k8s_controller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import rota
from rota.testing import quick_config, running_orchestrator, tenants

__all__ = ["connect", "endpoint"]


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A fresh embedded orchestrator served over real gRPC on a loopback port."""
    with running_orchestrator(quick_config()) as (ep, _engine):
        yield ep


@pytest.fixture
def connect(endpoint: str) -> Iterator[Callable[..., rota.Gpu]]:
    """``connect(tenant, group="g")`` -> a Gpu on the test orchestrator, closed after the test."""
    with tenants(endpoint) as connect:
        yield connect
