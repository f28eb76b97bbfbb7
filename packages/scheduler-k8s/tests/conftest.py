"""Fixtures of rota-scheduler-k8s's tests: the orchestrator's settings, the ``rota`` CLI.

``orchestrator`` is rota-core's pytest plugin (rota.fixtures), ``fake_api`` rota_k8s_controller's."""

from __future__ import annotations

from typing import Any

import pytest

from rota.orchestrator import OrchestratorConfig
from rota.testing import cli_with_plugins


@pytest.fixture
def orchestrator_config() -> OrchestratorConfig:
    """The default settings: the status tests' tenants acquire over rota.v1 without a session (no heartbeats)."""
    return OrchestratorConfig()


@pytest.fixture
def rota_cli() -> Any:
    """The real ``rota`` click group with plugin commands added, as ``rota`` builds it."""
    cli = cli_with_plugins()
    assert "k8s" in cli.commands, "rota_k8s.plugin did not add `rota k8s`"
    return cli
