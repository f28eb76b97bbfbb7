"""Fixtures of rota-scheduler-k8s's tests: a FakeKubeApi, a real orchestrator, a controller."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from k8s_checks import Tenant
from k8s_fake_api import FakeKubeApi

from rota.testing import running_orchestrator


@pytest.fixture
def fake_api() -> Iterator[FakeKubeApi]:
    api = FakeKubeApi().start()
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, Any]]:
    with running_orchestrator() as (endpoint, engine):
        yield endpoint, engine


@pytest.fixture
def core_api(fake_api: FakeKubeApi) -> Any:
    """The official client's CoreV1Api, pointed at the fake."""
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = fake_api.url
    return client.CoreV1Api(client.ApiClient(cfg))


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


@pytest.fixture
def rota_cli() -> Any:
    """The real ``rota`` click group with plugin commands added, as ``rota`` builds it."""
    from rota._plugins import plugin_manager
    from rota.cli.main import cli

    plugin_manager().hook.rota_cli(cli=cli)
    assert "k8s" in cli.commands, "rota_k8s.plugin did not add `rota k8s`"
    return cli
