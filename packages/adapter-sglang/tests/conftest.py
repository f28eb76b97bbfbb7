"""Fixtures of rota-adapter-sglang's tests: a real orchestrator on loopback, fake SGLang engines."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import rota
from rota.testing import quick_config, running_orchestrator, tenants

sys.path.insert(0, str(Path(__file__).parent))


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
