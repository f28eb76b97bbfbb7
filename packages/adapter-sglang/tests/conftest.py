"""Fixtures of rota-adapter-sglang's tests: a real orchestrator on loopback, fake SGLang engines."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import rota
from rota._engine import OrchestratorConfig
from rota.testing import running_orchestrator

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def endpoint() -> Iterator[str]:
    with running_orchestrator(OrchestratorConfig(ttl_s=5.0, park_timeout_s=30.0)) as (ep, _engine):
        yield ep


@pytest.fixture
def connect(endpoint: str) -> Iterator[Callable[..., rota.Gpu]]:
    made: list[rota.Gpu] = []

    def _connect(tenant: str, group: str = "g") -> rota.Gpu:
        gpu = rota.connect(group=group, tenant=tenant, endpoint=endpoint)
        made.append(gpu)
        return gpu

    yield _connect
    for gpu in made:
        gpu.close()
