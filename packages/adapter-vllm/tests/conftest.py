"""Fixtures of rota-adapter-vllm's tests: a real orchestrator on loopback, fake vLLM engines.

Tiers: the fast tier (default) runs against :class:`rota_serving.testing.FakeVllmServer`; tests marked ``heavy``
need the real vLLM CPU server and run only with ``ROTA_HEAVY_TESTS=1`` (see
``heavy_setup.sh``, which builds the separate venv they need).
"""

from __future__ import annotations

import pytest

from rota_serving.testing.fixtures import connect, endpoint, fake_vllm  # noqa: F401


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "heavy: needs a real inference engine (ROTA_HEAVY_TESTS=1 and its venv)")

