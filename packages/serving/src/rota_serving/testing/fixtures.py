"""pytest fixtures for the tests of rota_serving and of the adapters built on it.

A ``conftest.py`` imports the ones it uses (pytest finds fixtures by name there)::

    from rota_serving.testing.fixtures import connect, endpoint, fake_vllm  # noqa: F401
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from rota.fixtures import connect, endpoint
from rota_serving.testing.fake_sglang import FakeSglangServer
from rota_serving.testing.fake_vllm import FakeVllmServer


@pytest.fixture
def fake_vllm() -> Iterator[FakeVllmServer]:
    """A fake vLLM server on loopback (in this process), shut down after the test."""
    with FakeVllmServer().running() as srv:
        yield srv


@pytest.fixture
def fake_sglang() -> Iterator[FakeSglangServer]:
    """A fake SGLang server on loopback (in this process), shut down after the test."""
    with FakeSglangServer().running() as srv:
        yield srv


__all__ = ["connect", "endpoint", "fake_sglang", "fake_vllm"]
