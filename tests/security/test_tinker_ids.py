"""Issue 45, row 11: the ids the Tinker service hands out must not carry a service-wide counter.

Ids were ``PREFIX-N-RANDOM`` with one ``N`` for the whole service (``req-159-…``, ``mallory-model-1952-…``): two
of the attacker's ids told her how many requests, sessions and models every other tenant made between them. The
service runs in this process (real HTTP on loopback); the victim uses the real SDK, the attacker raw HTTP with her
own key. Every id she is given must be its prefix and random bits only, and nothing in her ids may move with the
victim's traffic.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterator

import httpx
import pytest

tinker = pytest.importorskip("tinker")

from rota_tinker import BaseModelSpec, ServiceConfig, Tenant, TinkerService  # noqa: E402

KEYS = {name: "tml-" + secrets.token_urlsafe(32) for name in ("alice", "mallory")}
BASE = BaseModelSpec("sec/ids", vocab=64, dim=16, layers=1, heads=2, max_len=64, seed=3)
RANDOM = r"[0-9a-f]{32}"  # 128 random bits


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    config = ServiceConfig(tenants=tuple(Tenant(n, k) for n, k in KEYS.items()),
                           data_dir=str(tmp_path_factory.mktemp("ids-sec")), base_models={BASE.name: BASE},
                           long_poll_s=1.0)
    with TinkerService(config) as service:
        yield service


def post(svc: TinkerService, route: str, tenant: str, body: dict) -> httpx.Response:
    r = httpx.post(f"{svc.url}/api/v1/{route}", json=body, headers={"X-API-Key": KEYS[tenant]}, timeout=60)
    assert r.status_code == 200, r.text
    return r


def mallorys_ids(svc: TinkerService) -> dict[str, str]:
    """One id of each kind the attacker can get without a model of her own: a session, a sampling session and a
    request (a future)."""
    session = post(svc, "create_session", "mallory", {"tags": [], "sdk_version": "0"}).json()["session_id"]
    sampler = post(svc, "create_sampling_session", "mallory", {
        "session_id": session, "sampling_session_seq_id": 0, "base_model": BASE.name}).json()["sampling_session_id"]
    request = post(svc, "asample", "mallory", {
        "sampling_session_id": sampler, "seq_id": 1, "num_samples": 1,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
        "sampling_params": {"max_tokens": 1, "temperature": 0.0, "stop": []}}).json()["request_id"]
    return {"session": session, "sampler": sampler, "request": request}


def test_row11_ids_carry_random_bits_only_and_do_not_count_other_tenants_requests(svc: TinkerService) -> None:
    before = mallorys_ids(svc)
    # the victim's traffic between two of the attacker's probes: a session, a LoRA model, a few requests
    service = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])
    tc = service.create_lora_training_client(base_model=BASE.name, rank=2, seed=1).result(timeout=120)
    sampler = tc.save_weights_and_get_sampling_client().result(timeout=120)
    for _ in range(3):
        sampler.sample(tinker.types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                       sampling_params=tinker.types.SamplingParams(max_tokens=2, stop=[])).result(timeout=120)
    after = mallorys_ids(svc)
    shapes = {"session": rf"mallory-session-{RANDOM}", "sampler": rf"mallory-sampler-{RANDOM}",
              "request": rf"req-{RANDOM}"}
    for ids in (before, after):
        for kind, value in ids.items():
            assert re.fullmatch(shapes[kind], value), f"{kind} id {value!r} is not its prefix and 128 random bits"
    assert re.fullmatch(rf"alice-model-{RANDOM}", tc.model_id), tc.model_id
    # and nothing decimal in them moves with alice's traffic (the old ids' counter rose by her requests)
    for kind in before:
        numbers = [[int(p) for p in ids[kind].split("-") if p.isdecimal() and len(p) < 12] for ids in (before, after)]
        assert numbers == [[], []], f"{kind} ids {before[kind]!r} and {after[kind]!r} carry a counter"
