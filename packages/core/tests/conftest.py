"""rota-core's tests run their orchestrator with a shorter TTL and park timeout than the fixtures' default.

``orchestrator``, ``endpoint``, ``connect`` and ``child_env`` are rota-core's pytest plugin (rota.fixtures).
"""

from __future__ import annotations

import pytest

from rota.orchestrator import OrchestratorConfig


@pytest.fixture
def orchestrator_config() -> OrchestratorConfig:
    return OrchestratorConfig(ttl_s=2.0, park_timeout_s=10.0)
