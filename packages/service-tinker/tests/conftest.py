"""Fixtures of rota-service-tinker's tests: a real orchestrator, the service on loopback, SDK clients.

Everything is real: the rota orchestrator serves gRPC on a loopback port, the service
serves HTTP on another, workers are spawned processes, and clients are the official
``tinker`` SDK (``tinker.ServiceClient``), exactly as users would run them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import tinker
from tinker_testlib import KEYS, WIDE

from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator
from rota_tinker import DEFAULT_BASE_MODELS, ServiceConfig, Tenant, TinkerService

os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's telemetry is accepted by the service, but keep it quiet
os.environ["HF_HUB_OFFLINE"] = "1"  # no test downloads anything: models are built in the tests



@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    """The service for every tenant of KEYS, its workers on one rota group of a fresh orchestrator."""
    with running_orchestrator(OrchestratorConfig(ttl_s=10.0, park_timeout_s=60.0)) as (endpoint, _engine):
        config = ServiceConfig(tenants=tuple(Tenant(n, k) for n, k in KEYS.items()),
                               data_dir=str(tmp_path_factory.mktemp("tinker")), endpoint=endpoint,
                               group="tinker-test", long_poll_s=2.0,
                               base_models={**DEFAULT_BASE_MODELS, WIDE.name: WIDE})
        with TinkerService(config) as svc:
            yield svc


@pytest.fixture(scope="module")
def client(service: TinkerService) -> Callable[[str], tinker.ServiceClient]:
    """``client(tenant)`` -> a real tinker.ServiceClient with that tenant's key."""
    made: dict[str, tinker.ServiceClient] = {}

    def _client(tenant: str) -> tinker.ServiceClient:
        if tenant not in made:
            made[tenant] = tinker.ServiceClient(base_url=service.url, api_key=KEYS[tenant])
        return made[tenant]

    return _client


def pytest_sessionfinish() -> None:
    """Quiet the tinker SDK's heartbeat warnings once the run is over. Test services stop with no farewell
    (``farewell_s`` 0: a farewell waits up to a heartbeat period per service), so the SDK clients of stopped
    services keep heart-beating at closed ports and warn after 2 minutes, after pytest's closing line."""
    import logging

    logging.getLogger("tinker.lib.internal_client_holder").setLevel(logging.ERROR)
