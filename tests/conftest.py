"""Fixtures shared by the cross-package tests (tests/security, tests/bench)."""

from __future__ import annotations

import pytest

from rota.testing import child_environment


@pytest.fixture
def child_env(tmp_path) -> dict[str, str]:
    """Environment for tenant subprocesses: no inherited ROTA_* settings, own runtime dir."""
    return child_environment(tmp_path / "runtime")
