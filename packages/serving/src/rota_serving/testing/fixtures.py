"""pytest fixtures for the tests of rota_serving and of the adapters built on it: ``fake_vllm``, ``fake_sglang``.

A pytest plugin (rota-serving's ``pytest11`` entry point); ``endpoint`` and ``connect`` are
:mod:`rota.fixtures`'.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

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


__all__ = ["fake_sglang", "fake_vllm"]
