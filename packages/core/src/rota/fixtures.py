"""pytest fixtures for testing a plugin against a real orchestrator (needs pytest).

A ``conftest.py`` imports the ones it uses (pytest finds fixtures by name there)::

    from rota.fixtures import connect, endpoint  # noqa: F401
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
