"""pytest fixtures for tests against :class:`~rota_k8s_controller.testing.FakeKubeApi`: ``fake_api``, ``core_api``.

A pytest plugin (rota-k8s-controller's ``pytest11`` entry point): a test names them and imports nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rota_k8s_controller.testing import FakeKubeApi

__all__ = ["core_api", "fake_api"]


@pytest.fixture
def fake_api() -> Iterator[FakeKubeApi]:
    """A FakeKubeApi serving on a loopback port, closed after the test."""
    api = FakeKubeApi().start()
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
def core_api(fake_api: FakeKubeApi) -> Any:
    """The official client's CoreV1Api, pointed at the fake."""
    from kubernetes import client

    cfg = client.Configuration()
    cfg.host = fake_api.url
    return client.CoreV1Api(client.ApiClient(cfg))
