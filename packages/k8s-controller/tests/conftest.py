"""Fixtures of rota-k8s-controller's tests: a real orchestrator, tenants over gRPC (``fake_api``, ``core_api``: the
package's pytest plugin)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from grpc_tenant import Tenant

from rota.testing import running_orchestrator


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, Any]]:
    with running_orchestrator() as (endpoint, engine):
        yield endpoint, engine


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
