"""Fixtures of rota-scheduler-k8s's tests: a real orchestrator, the ``rota`` CLI.

``fake_api`` is rota_k8s_controller's pytest plugin."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rota.testing import cli_with_plugins, running_orchestrator


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, Any]]:
    with running_orchestrator() as (endpoint, engine):
        yield endpoint, engine


@pytest.fixture
def rota_cli() -> Any:
    """The real ``rota`` click group with plugin commands added, as ``rota`` builds it."""
    cli = cli_with_plugins()
    assert "k8s" in cli.commands, "rota_k8s.plugin did not add `rota k8s`"
    return cli
