"""Markers of rota-adapter-vllm's tests; the fixtures (``endpoint``, ``connect``, ``fake_vllm``) are rota's and
rota_serving's pytest plugins.

Tiers: the fast tier (default) runs against :class:`rota_serving.testing.FakeVllmServer`; tests marked ``heavy``
need the real vLLM CPU server and run only with ``ROTA_HEAVY_TESTS=1`` (see
``heavy_setup.sh``, which builds the separate venv they need).
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "heavy: needs a real inference engine (ROTA_HEAVY_TESTS=1 and its venv)")

