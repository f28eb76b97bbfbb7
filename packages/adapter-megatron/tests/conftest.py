"""Fixtures of rota-adapter-megatron's tests: a real orchestrator on loopback, tenants, cleanup.

Every test here needs megatron-core (the adapter's own dependency, installed by
``./dev setup``); a missing one skips with the pip line that fixes it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

import rota
from rota._engine import OrchestratorConfig
from rota.testing import running_orchestrator

torch.set_num_threads(1)

try:
    import rota_megatron  # noqa: F401  (checks the megatron-core version)
except ImportError as exc:  # MegatronVersionError included
    pytest.skip(f"rota_megatron cannot load: {exc}", allow_module_level=True)


@pytest.fixture
def endpoint() -> Iterator[str]:
    """A fresh embedded orchestrator served over real gRPC on a loopback port."""
    with running_orchestrator(OrchestratorConfig(ttl_s=5.0, park_timeout_s=30.0)) as (ep, _engine):
        yield ep


@pytest.fixture
def connect(endpoint: str) -> Iterator[Callable[..., rota.Gpu]]:
    """``connect(tenant, group="g")`` -> a Gpu on the test orchestrator; closed (and untracked) after the test."""
    made: list[rota.Gpu] = []

    def _connect(tenant: str, group: str = "g") -> rota.Gpu:
        gpu = rota.connect(group=group, tenant=tenant, endpoint=endpoint)
        made.append(gpu)
        return gpu

    yield _connect
    from rota_fsdp import _tracked

    for tracked in list(_tracked._models.values()):
        if any(tracked.gpu is g for g in made):
            tracked.untrack()
    for gpu in made:
        gpu.close()
