"""pytest fixtures for the tests of rota_serving and of the adapters built on it.

A ``conftest.py`` imports the ones it uses (pytest finds fixtures by name there)::

    from rota_serving.testing.fixtures import connect, endpoint, fake_vllm  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import rota
from rota.testing import quick_config, running_orchestrator, tenants
from rota_serving.testing.fake_sglang import FakeSglangServer
from rota_serving.testing.fake_vllm import FakeVllmServer


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


@pytest.fixture
def fake_vllm() -> Iterator[FakeVllmServer]:
    """A fake vLLM server on loopback (in this process), shut down after the test."""
    with FakeVllmServer().running() as srv:
        yield srv


@pytest.fixture
def fake_sglang() -> Iterator[FakeSglangServer]:
    """A fake SGLang server on loopback (in this process), shut down after the test."""
    with FakeSglangServer().running() as srv:
        yield srv


__all__ = ["connect", "endpoint", "fake_sglang", "fake_vllm"]
