"""Fixtures of rota-core's tests: a real orchestrator on loopback, an environment for tenant processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rota.orchestrator import Orchestrator, OrchestratorConfig
from rota.testing import child_environment, running_orchestrator


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, Orchestrator]]:
    """A fresh embedded orchestrator (short TTL) served over real gRPC on a loopback port."""
    with running_orchestrator(OrchestratorConfig(ttl_s=2.0, park_timeout_s=10.0)) as served:
        yield served


@pytest.fixture
def child_env(tmp_path) -> dict[str, str]:
    """Environment for tenant subprocesses: no inherited ROTA_* settings, own runtime dir."""
    return child_environment(tmp_path / "runtime")
