"""Fixtures: real etcd members on loopback (Debian etcd-server), one key prefix per test."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from rota_etcd.testing import EtcdCluster, etcd_available


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.etcd)
            if not etcd_available():
                item.add_marker(pytest.mark.skip(reason="needs the etcd binary: Debian etcd-server "
                                                        "(bash scripts/services.sh install)"))


@pytest.fixture(scope="session")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdCluster]:
    """One etcd member for the whole session; tests keep apart through :func:`prefix`."""
    with EtcdCluster(tmp_path_factory.mktemp("etcd"), size=1) as cluster:
        yield cluster


@pytest.fixture
def etcd3(tmp_path) -> Iterator[EtcdCluster]:
    """A fresh 3-member cluster (tests kill members of it)."""
    with EtcdCluster(tmp_path / "etcd3", size=3) as cluster:
        yield cluster


@pytest.fixture
def prefix(monkeypatch: pytest.MonkeyPatch) -> str:
    """A key prefix of this test's own, also set as ROTA_ETCD_PREFIX for child processes."""
    value = f"/rota-test/{uuid.uuid4().hex[:10]}"
    monkeypatch.setenv("ROTA_ETCD_PREFIX", value)
    monkeypatch.setenv("ROTA_ETCD_LEADER_TTL", "2")
    return value


@pytest.fixture
def child_env(child_env: dict[str, str], prefix: str) -> dict[str, str]:
    """rota.fixtures' environment for tenant subprocesses, with this test's etcd prefix (orchestrators too)."""
    return {**child_env, "ROTA_ETCD_PREFIX": prefix, "ROTA_ETCD_LEADER_TTL": "2"}
