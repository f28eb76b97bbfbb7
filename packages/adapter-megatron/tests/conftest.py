"""Fixtures of rota-adapter-megatron's tests: a real orchestrator on loopback, tenants, cleanup.

Every test here needs megatron-core (the adapter's own dependency, installed by
``./dev setup``); a missing one skips with the pip line that fixes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import rota
from rota.testing import quick_config, running_orchestrator, tenants

torch.set_num_threads(1)

try:
    import rota_megatron  # noqa: F401  (checks the megatron-core version)
except ImportError as exc:  # MegatronVersionError included
    pytest.skip(f"rota_megatron cannot load: {exc}", allow_module_level=True)


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
