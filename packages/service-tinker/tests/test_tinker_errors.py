"""Bad requests get clear HTTP errors: keys, ownership, content types, malformed bodies, unknown ids."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import tinker
from tinker import types
from tinker_testlib import KEYS

from rota_tinker import TinkerService

JSON = {"Content-Type": "application/json"}


def post(svc: TinkerService, route: str, key: str | None, *, json: object = None, content: bytes | None = None,
         headers: dict[str, str] | None = None) -> httpx.Response:
    h = {} if key is None else {"X-API-Key": key}
    return httpx.post(f"{svc.url}/api/v1/{route}", json=json, content=content, headers={**h, **(headers or {})},
                      timeout=30)


def test_sdk_with_a_wrong_key_is_refused(service: TinkerService) -> None:
    with pytest.raises(tinker.AuthenticationError, match="not known to this service"):
        sc = tinker.ServiceClient(base_url=service.url, api_key="tml-nobody-0000000000")
        sc.create_lora_training_client(base_model="rota/tiny", rank=2).result(timeout=60)


def test_missing_and_unknown_keys_are_401(service: TinkerService) -> None:
    r = post(service, "create_session", None, json={"tags": [], "sdk_version": "x"})
    assert r.status_code == 401 and "X-API-Key" in r.json()["detail"]
    r = post(service, "create_session", "tml-nobody-0000000000", json={"tags": [], "sdk_version": "x"})
    assert r.status_code == 401
    assert httpx.get(f"{service.url}/api/v1/healthz", timeout=30).json() == {"status": "ok"}


def test_another_tenants_model_is_403(service: TinkerService, client: Callable[[str], tinker.ServiceClient]) -> None:
    tc = client("alice").create_lora_training_client(base_model="rota/tiny", rank=2, seed=1).result(timeout=120)
    r = post(service, "get_info", KEYS["bob"], json={"model_id": tc.model_id})
    assert r.status_code == 403 and "another tenant" in r.json()["detail"]
    r = post(service, "optim_step", KEYS["bob"], json={"model_id": tc.model_id, "adam_params": {}})
    assert r.status_code == 403
    r = post(service, "get_info", KEYS["alice"], json={"model_id": tc.model_id})
    assert r.status_code == 200 and r.json()["is_lora"] is True


def test_unknown_ids_are_404(service: TinkerService, client: Callable[[str], tinker.ServiceClient]) -> None:
    r = post(service, "get_info", KEYS["alice"], json={"model_id": "no-such-model"})
    assert r.status_code == 404 and "no-such-model" in r.json()["detail"]
    r = post(service, "retrieve_future", KEYS["alice"], json={"request_id": "req-0-0"})
    assert r.status_code == 404
    assert post(service, "no_such_route", KEYS["alice"], json={}).status_code == 404
    with pytest.raises(tinker.NotFoundError, match="rota/tiny"):
        client("alice").create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result(timeout=60)


def test_content_types_and_malformed_bodies(service: TinkerService) -> None:
    k = KEYS["alice"]
    r = post(service, "forward_backward", k, json={"model_id": "x"})
    assert r.status_code == 415 and "application/x-protobuf" in r.json()["detail"]
    r = post(service, "forward_backward", k, content=b"\xff\xfe garbage", headers={"Content-Type":
                                                                                    "application/x-protobuf"})
    assert r.status_code == 400 and "ForwardBackwardRequest" in r.json()["detail"]
    r = post(service, "forward_backward", k, content=b"", headers={"Content-Type": "application/x-protobuf",
                                                                  "Content-Encoding": "br"})
    assert r.status_code == 415 and "br" in r.json()["detail"]
    r = post(service, "create_session", k, content=b"{}", headers={"Content-Type": "text/plain"})
    assert r.status_code == 415 and "application/json" in r.json()["detail"]
    r = post(service, "create_session", k, content=b"{not json", headers=JSON)
    assert r.status_code == 400 and "JSON" in r.json()["detail"]
    r = post(service, "create_session", k, json=[1, 2])
    assert r.status_code == 400 and "object" in r.json()["detail"]
    r = httpx.get(f"{service.url}/api/v1/create_session", headers={"X-API-Key": k}, timeout=30)
    assert r.status_code == 405


def test_bad_fields_are_named(service: TinkerService, client: Callable[[str], tinker.ServiceClient]) -> None:
    sc = client("alice")
    with pytest.raises(tinker.BadRequestError, match="rank"):
        sc.create_lora_training_client(base_model="rota/tiny", rank=10_000).result(timeout=60)
    tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=3).result(timeout=120)
    big = types.Datum(model_input=types.ModelInput.from_ints([1, 500]),
                      loss_fn_inputs={"target_tokens": types.TensorData(data=[1, 2], dtype="int64", shape=[2])})
    with pytest.raises(tinker.BadRequestError, match=r"vocabulary of 128 tokens \[0, 128\)"):
        tc.forward_backward([big], "cross_entropy").result(timeout=60)
    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[1, 2], dtype="int64", shape=[2])})
    with pytest.raises(tinker.BadRequestError, match="one value per input position"):
        tc.forward_backward([short], "cross_entropy").result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="learning_rate"):
        tc.optim_step(types.AdamParams(learning_rate=-1.0)).result(timeout=60)
    r = post(service, "session_heartbeat", KEYS["alice"], json={})
    assert r.status_code == 400 and "session_id" in r.json()["detail"]
    r = post(service, "asample", KEYS["alice"], json={"base_model": "rota/tiny", "prompt": {"chunks": []},
                                                      "sampling_params": {}})
    assert r.status_code == 400 and "no tokens" in r.json()["detail"]
    r = post(service, "asample", KEYS["alice"], json={
        "base_model": "rota/tiny", "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1]}]},
        "sampling_params": {"stop": ["\n"]}})
    assert r.status_code == 400 and "token ids" in r.json()["detail"]
