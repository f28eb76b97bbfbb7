"""Fixtures of rota-k8s-controller's tests: the orchestrator's settings, tenants over gRPC (``orchestrator`` is
rota-core's pytest plugin, rota.fixtures; ``fake_api`` and ``core_api`` the package's own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from grpc_tenant import Tenant

from rota.orchestrator import OrchestratorConfig


@pytest.fixture
def orchestrator_config() -> OrchestratorConfig:
    """The default settings: these tenants acquire over rota.v1 without a session (no heartbeats)."""
    return OrchestratorConfig()


@pytest.fixture
def tenants(orchestrator: tuple[str, Any]) -> Iterator[Callable[[str, str], Tenant]]:
    made: list[Tenant] = []

    def make(job_id: str, group_id: str) -> Tenant:
        t = Tenant(orchestrator[0], job_id, group_id)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()
