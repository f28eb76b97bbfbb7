"""Fixtures of rota-adapter-vllm's tests: a real orchestrator on loopback, fake vLLM engines.

Tiers: the fast tier (default) runs against :mod:`vllm_fakes`; tests marked ``heavy``
need the real vLLM CPU server and run only with ``ROTA_HEAVY_TESTS=1`` (see
``heavy_setup.sh``, which builds the separate venv they need).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import rota
from rota.testing import quick_config, running_orchestrator, tenants

sys.path.insert(0, str(Path(__file__).parent))

from vllm_fakes import FakeVllmServer


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "heavy: needs a real inference engine (ROTA_HEAVY_TESTS=1 and its venv)")


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
    srv = FakeVllmServer().start()
    yield srv
    srv.shutdown()
    srv.server_close()
