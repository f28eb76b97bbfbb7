"""Fixtures of rota-torch's tests: a real orchestrator on loopback and tenants whose models are untracked after."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import rota
from rota.testing import quick_config, running_orchestrator, tenants
from rota_torch.testing import untrack_models_of

torch.set_num_threads(1)


@pytest.fixture
def connect() -> Iterator[Callable[..., rota.Gpu]]:
    """``connect(tenant, group="g")`` -> a Gpu on a fresh orchestrator; untracked and closed after the test."""
    with running_orchestrator(quick_config()) as (endpoint, _engine), \
            tenants(endpoint, before_close=untrack_models_of) as connect:
        yield connect
