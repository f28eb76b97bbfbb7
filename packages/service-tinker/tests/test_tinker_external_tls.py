"""Weights out over TLS: a service with --tls-cert hands out https:// signed URLs (they were http://, which a
TLS listener never answers), and a plain urllib GET that trusts the service's CA fetches them."""

from __future__ import annotations

import ssl
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types
from tinker_testlib import KEYS

from rota_tinker import DEFAULT_BASE_MODELS, ServiceConfig, Tenant, TinkerService
from tests.security.test_tls import pki  # noqa: F401  (fixture: a test CA and a certificate for 127.0.0.1)


def test_signed_urls_of_a_tls_service_are_https(tmp_path: Path, pki: Path,  # noqa: F811
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(pki / "ca.pem"))  # the SDK (httpx) trusts the test CA
    cfg = ServiceConfig(tenants=(Tenant("alice", KEYS["alice"]),), data_dir=str(tmp_path / "data"),
                        base_models=dict(DEFAULT_BASE_MODELS), tls_cert=str(pki / "server.pem"),
                        tls_key=str(pki / "server.key"))
    with TinkerService(cfg) as svc:
        assert svc.url.startswith("https://")
        sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])
        tc: Any = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=1).result(timeout=120)
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                            loss_fn_inputs={"target_tokens": types.TensorData(data=[2, 3, 4], dtype="int64",
                                                                              shape=[3])})
        tc.forward_backward([datum], "cross_entropy").result(timeout=120)
        path = tc.save_weights_external("tls-out").result(timeout=120).path
        rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["alice"])
        got = rest.get_external_weights_urls(path).result(timeout=120).urls
        assert got and all(u.startswith(svc.url + "/api/v1/external_weights/") for u in got.values()), got
        ctx = ssl.create_default_context(cafile=str(pki / "ca.pem"))
        for url in got.values():
            with urllib.request.urlopen(url, context=ctx, timeout=60) as r:
                assert r.status == 200 and r.read()
        sc.close("success").result(30)
