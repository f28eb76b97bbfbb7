"""Fixtures shared by the cross-package tests: a real orchestrator on loopback."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

from rota._engine import Orchestrator, OrchestratorConfig
from rota.testing import running_orchestrator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def orchestrator() -> Iterator[tuple[str, Orchestrator]]:
    """A fresh embedded orchestrator (short TTL) served over real gRPC on a loopback port."""
    with running_orchestrator(OrchestratorConfig(ttl_s=2.0, park_timeout_s=10.0)) as served:
        yield served


@pytest.fixture
def child_env(tmp_path) -> dict[str, str]:
    """Environment for tenant subprocesses: no inherited ROTA_* settings, own runtime dir."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env["ROTA_RUNTIME_DIR"] = str(tmp_path / "runtime")
    env["PYTHONUNBUFFERED"] = "1"
    return env


PYTHON = sys.executable
