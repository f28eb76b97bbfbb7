"""Weights out through the SDK, as ``tinker_cookbook.weights.download`` takes them: ``save_weights_external`` (clear,
or age-encrypted to a recipient), ``get_external_weights_urls``, a plain ``urllib`` GET of each signed URL (no API
key); the files load with peft (LoRA on a tiny Qwen3) or transformers (full model) and give the service's logprobs.
Signed URLs refuse tampering, expiry and another tenant's key."""

from __future__ import annotations

import datetime
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker_testlib import KEYS, full_training_client, serving_tiny_qwen

from rota_tinker import TinkerService

QWEN = "acme/Qwen3-Tiny"
TIMEOUT = 180
IDS = [17, 42, 99, 5, 230, 61, 7, 150, 33, 2]


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with serving_tiny_qwen(tmp_path_factory.mktemp("external"), "tinker-external", seed=6) as s:
        yield s


def trained(sc: tinker.ServiceClient, mode: str) -> Any:
    tc = (sc.create_lora_training_client(base_model=QWEN, rank=4, seed=3).result(timeout=TIMEOUT) if mode == "lora"
          else full_training_client(sc, QWEN))
    datum = types.Datum(model_input=types.ModelInput.from_ints(IDS[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(IDS[1:], np.int64)})
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy").result(timeout=TIMEOUT)
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT)
    return tc


def fetch_all(urls: dict[str, str], out: Path) -> None:
    """What weights.download does: one plain urllib GET per signed URL, no credentials."""
    out.mkdir(parents=True)
    for name, url in urls.items():
        urllib.request.urlretrieve(url, str(out / name))


def local_logprobs(svc: TinkerService, folder: Path) -> np.ndarray:
    import peft
    from transformers import AutoModelForCausalLM

    if (folder / "adapter_config.json").exists():
        model = peft.PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(svc.config.base_models[QWEN].path), str(folder))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(folder))
    with torch.no_grad():
        logits = model(torch.tensor([IDS[:-1]])).logits[0].float()
    return torch.gather(torch.log_softmax(logits, -1), 1, torch.tensor(IDS[1:]).unsqueeze(1)).squeeze(1).numpy()


@pytest.mark.parametrize("mode", ["lora", "full"])
def test_external_weights_download_with_urllib_and_load(svc: TinkerService, tmp_path: Path, mode: str) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])
    rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["alice"])
    tc = trained(sc, mode)
    path = tc.save_weights_external(f"out-{mode}", ttl_seconds=3600).result(timeout=TIMEOUT).path
    assert path == f"tinker://{tc.model_id}/external_weights/out-{mode}"
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(tc.model_id).result(timeout=TIMEOUT).checkpoints}
    assert listed[f"external_weights/out-{mode}"].checkpoint_type == "external"
    assert listed[f"external_weights/out-{mode}"].expires_at is not None
    got = rest.get_external_weights_urls(path).result(timeout=TIMEOUT)
    want = {"adapter_config.json", "adapter_model.safetensors"} if mode == "lora" else {"config.json"}
    assert want <= set(got.urls) and "optimizer.pt" not in got.urls
    assert got.expires > datetime.datetime.now(datetime.timezone.utc)
    assert all(u.startswith(svc.url + "/api/v1/external_weights/") for u in got.urls.values())
    fetch_all(got.urls, tmp_path / "out")
    sampler = sc.create_sampling_client(model_path=tc.save_weights_for_sampler(f"s-{mode}").result(
        timeout=TIMEOUT).path).result(timeout=TIMEOUT)
    service_lp = sampler.compute_logprobs(types.ModelInput.from_ints(IDS)).result(timeout=TIMEOUT)
    np.testing.assert_allclose(local_logprobs(svc, tmp_path / "out"), np.asarray(service_lp[1:], np.float64),
                               rtol=0, atol=1e-5)
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT)
    with pytest.raises(urllib.error.HTTPError) as gone:  # its URLs die with it
        urllib.request.urlopen(next(iter(got.urls.values())))
    assert gone.value.code == 403


def test_age_encrypted_external_weights_decrypt_and_load(svc: TinkerService, tmp_path: Path) -> None:
    """As weights.download exports a training checkpoint: encrypted to a fresh x25519 identity, then decrypted."""
    import pyrage

    identity = pyrage.x25519.Identity.generate()
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["bob"])
    rest = tinker.RestClient(base_url=svc.url, api_key=KEYS["bob"])
    state = trained(sc, "lora").save_state("ck").result(timeout=TIMEOUT).path
    tc = sc.create_training_client_from_state(state).result(timeout=TIMEOUT)
    path = tc.save_weights_external("download", ttl_seconds=3600,
                                    age_encryption_recipients=[str(identity.to_public())]).result(timeout=TIMEOUT).path
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result(timeout=TIMEOUT)  # weights.download renews it
    urls = rest.get_external_weights_urls(path).result(timeout=TIMEOUT).urls
    assert urls and all(name.endswith(".age") for name in urls)
    fetch_all(urls, tmp_path / "enc")
    clear = tmp_path / "clear"
    clear.mkdir()
    for name in urls:
        assert (tmp_path / "enc" / name).read_bytes().startswith(b"age-encryption.org/v1")
        pyrage.decrypt_file(str(tmp_path / "enc" / name), str(clear / name.removesuffix(".age")), [identity])
    sampler = sc.create_sampling_client(model_path=state).result(timeout=TIMEOUT)
    service_lp = sampler.compute_logprobs(types.ModelInput.from_ints(IDS)).result(timeout=TIMEOUT)
    np.testing.assert_allclose(local_logprobs(svc, clear), np.asarray(service_lp[1:], np.float64), rtol=0, atol=1e-5)
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        tc.save_weights_external("bad", age_encryption_recipients=["not-a-key"]).result(timeout=30)


def test_signed_urls_refuse_tampering_expiry_and_other_tenants(svc: TinkerService) -> None:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["carol"])
    tc = trained(sc, "lora")
    path = tc.save_weights_external("guarded").result(timeout=TIMEOUT).path
    urls = tinker.RestClient(base_url=svc.url, api_key=KEYS["carol"]).get_external_weights_urls(path).result(
        timeout=TIMEOUT).urls
    url = urls["adapter_model.safetensors"]
    assert httpx.get(url, timeout=30).status_code == 200
    assert httpx.get(url, headers={"X-API-Key": KEYS["carol"]}, timeout=30).status_code == 200
    base, query = url.split("?")
    expires = int(query.split("expires=")[1].split("&")[0])
    sig = query.split("sig=")[1]
    for bad in (f"{base}?expires={expires + 3600}&sig={sig}",  # a later expiry under the same signature
                f"{base}?expires={expires}&sig={'0' * len(sig)}",
                f"{base}?expires={int(time.time()) - 10}&sig={sig}",
                base, base.replace("adapter_model.safetensors", "adapter_config.json") + "?" + query,
                url.replace(tc.model_id, "alice-model-1-00000000")):
        r = httpx.get(bad, timeout=30)
        assert r.status_code in (403, 404) and b"safetensors" not in r.content[:64], (bad, r.status_code)
    r = httpx.get(url, headers={"X-API-Key": KEYS["dave"]}, timeout=30)
    assert r.status_code == 403 and "another tenant" in r.json()["detail"]
    with pytest.raises(tinker.PermissionDeniedError):
        tinker.RestClient(base_url=svc.url, api_key=KEYS["dave"]).get_external_weights_urls(path).result(
            timeout=TIMEOUT)
    r = httpx.post(f"{svc.url}/api/v1/save_weights_external", headers={"X-API-Key": KEYS["dave"]}, timeout=30,
                   json={"model_id": tc.model_id, "path": "stolen"})
    assert r.status_code == 403
    with pytest.raises(tinker.BadRequestError, match="exists"):
        tc.save_weights_external("guarded").result(timeout=30)
