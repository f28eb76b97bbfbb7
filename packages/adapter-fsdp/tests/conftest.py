"""Fixtures of rota-adapter-fsdp's tests: a real orchestrator on loopback, tenants, cleanup."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import rota
from rota.testing import quick_config, running_orchestrator, tenants

torch.set_num_threads(1)


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A fresh embedded orchestrator served over real gRPC on a loopback port."""
    with running_orchestrator(quick_config()) as (ep, _engine):
        yield ep


@pytest.fixture
def connect(endpoint: str) -> Iterator[Callable[..., rota.Gpu]]:
    """``connect(tenant, group="g")`` -> a Gpu on the test orchestrator; untracked and closed after the test."""
    from rota_torch.testing import untrack_models_of

    with tenants(endpoint, before_close=untrack_models_of) as connect:
        yield connect
