"""A quota reaches the tinker SDK as a status it acts on at once, on every route family (issue 34): the SDK retries
a 429 for 5 minutes inside its retry loop whatever x-should-retry says, so a quota is a 429 with x-should-retry:
false only where the SDK calls without that loop (create_session, create_sampling_session: RateLimitError), a
failed future on the routes answered with one (tests/security: row 20), and a 400 on the others (copy_weights:
BadRequestError), each naming the quota."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator

import pytest
import tinker
from tinker_testlib import KEYS, batch

from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator
from rota_tinker import DEFAULT_BASE_MODELS, ServiceConfig, Tenant, TinkerService

DEADLINE_S = 60.0  # a hang guard, not a threshold: a retried 429 holds the caller for 5 minutes


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with running_orchestrator(OrchestratorConfig(ttl_s=10.0, park_timeout_s=60.0)) as (endpoint, _engine):
        config = ServiceConfig(tenants=tuple(Tenant(n, k) for n, k in KEYS.items()),
                               data_dir=str(tmp_path_factory.mktemp("quota")), endpoint=endpoint,
                               group="tinker-quota", long_poll_s=2.0, base_models=DEFAULT_BASE_MODELS, max_sessions=1)
        with TinkerService(config) as svc:
            yield svc


def test_quotas_reach_the_sdk_as_errors_it_raises_at_once(service: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEYS["alice"])  # its one session
    tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=1).result(timeout=DEADLINE_S)
    tc.forward_backward(batch(0, seed=1), "cross_entropy").result(timeout=DEADLINE_S)
    state = tc.save_state("kept").result(timeout=DEADLINE_S).path
    started = time.monotonic()
    with pytest.raises(tinker.RateLimitError, match="max_sessions=1"):  # not retried: x-should-retry: false
        other = tinker.ServiceClient(base_url=service.url, api_key=KEYS["alice"])  # its session is made on first use
        other.create_lora_training_client(base_model="rota/tiny", rank=2).result(timeout=DEADLINE_S)
    with pytest.raises(tinker.RateLimitError, match="max_sessions=1"):
        sc.create_sampling_client(base_model="rota/tiny").result(timeout=DEADLINE_S)
    assert time.monotonic() - started < DEADLINE_S

    held = service.usage("alice")["bytes"]
    service.state.config = dataclasses.replace(service.state.config, max_bytes=held + 1)  # full: a copy passes it
    rest = tinker.RestClient(base_url=service.url, api_key=KEYS["alice"])
    fut = rest.copy_weights(state, "archive")
    with pytest.raises(tinker.BadRequestError, match=r"429 Too Many Requests: .*max_bytes="):
        fut.result(timeout=DEADLINE_S)  # inside the SDK's retry loop: a 429 would have held it for 5 minutes
    service.state.config = dataclasses.replace(service.state.config, max_bytes=held * 4)
    assert rest.copy_weights(state, "archive").result(timeout=DEADLINE_S)  # freed quota: the same call works
