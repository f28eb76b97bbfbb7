"""Fixtures of rota-scheduler-k8s's tests: a FakeKubeApi, a real orchestrator, the ``rota`` CLI."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rota.testing import running_orchestrator
from rota_k8s_controller.fixtures import fake_api  # noqa: F401


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, Any]]:
    with running_orchestrator() as (endpoint, engine):
        yield endpoint, engine


@pytest.fixture
def rota_cli() -> Any:
    """The real ``rota`` click group with plugin commands added, as ``rota`` builds it."""
    from rota._plugins import plugin_manager
    from rota.cli.main import cli

    plugin_manager().hook.rota_cli(cli=cli)
    assert "k8s" in cli.commands, "rota_k8s.plugin did not add `rota k8s`"
    return cli
