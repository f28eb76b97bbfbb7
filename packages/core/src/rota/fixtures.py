"""pytest fixtures for testing a plugin against a real orchestrator: ``orchestrator``, ``endpoint``, ``connect``.

A pytest plugin: rota-core registers it under the ``pytest11`` entry points, so every pytest run
where rota-core is installed has these fixtures; a test names them and imports nothing. The
other packages' fixtures come the same way: ``torch_connect`` (rota_torch), ``fake_vllm`` and
``fake_sglang`` (rota_serving), ``fake_api`` and ``core_api`` (rota_k8s_controller).

A test folder that needs other orchestrator settings overrides ``orchestrator_config`` in its
conftest (pytest's way); ``orchestrator``, ``endpoint`` and ``connect`` then serve with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

import rota
from rota.orchestrator import Orchestrator, OrchestratorConfig
from rota.testing import child_environment, quick_config, running_orchestrator, tenants

__all__ = ["child_env", "connect", "endpoint", "orchestrator", "orchestrator_config"]


@pytest.fixture
def orchestrator_config() -> OrchestratorConfig:
    """The settings ``orchestrator`` serves with: :func:`rota.testing.quick_config` (a test that goes wrong
    fails in seconds)."""
    return quick_config()


@pytest.fixture
def orchestrator(orchestrator_config: OrchestratorConfig) -> Iterator[tuple[str, Orchestrator]]:
    """(endpoint, orchestrator): a fresh embedded orchestrator served over real gRPC on a loopback port."""
    with running_orchestrator(orchestrator_config) as served:
        yield served


@pytest.fixture
def endpoint(orchestrator: tuple[str, Orchestrator]) -> str:
    """The address of the test's ``orchestrator``."""
    return orchestrator[0]


@pytest.fixture
def connect(endpoint: str) -> Iterator[Callable[..., rota.Gpu]]:
    """``connect(tenant, group="g")`` -> a Gpu on the test orchestrator, closed after the test."""
    with tenants(endpoint) as connect:
        yield connect


@pytest.fixture
def child_env(tmp_path) -> dict[str, str]:
    """Environment for tenant subprocesses: no inherited ROTA_* settings, their own runtime dir."""
    return child_environment(tmp_path / "runtime")
