"""What the service writes and counts: private files, names checked whole, bounded ephemeral weights, true estimates."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable

import httpx
import pytest
import tinker
from tinker_testlib import KEYS, batch

from rota_tinker import DEFAULT_BASE_MODELS, BaseModelSpec, TinkerService
from rota_tinker._http.state import EPHEMERAL_KEEP
from rota_tinker._worker.models import TinyLM, adapters_of, add_lora

TIMEOUT = 120


@pytest.mark.parametrize("spec", [*DEFAULT_BASE_MODELS.values(), BaseModelSpec("x/odd", vocab=50, dim=24, layers=3,
                                                                               heads=3, max_len=17)])
def test_state_estimates_count_the_real_parameters(spec: BaseModelSpec) -> None:
    """The byte quota's estimate (params, lora_params) counts exactly the parameters the workers build."""
    model = TinyLM(spec)
    assert spec.params() == sum(p.numel() for p in model.parameters())
    for targets in ({"attn": True, "mlp": True, "unembed": True}, {"attn": False, "mlp": True, "unembed": False},
                    {"attn": True, "mlp": False, "unembed": True}):
        adapters = adapters_of(add_lora(TinyLM(spec), 3, 0, targets))
        assert spec.lora_params(3, targets) == sum(p.numel() for p in adapters.parameters())


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_saved_weights_are_private_and_names_are_checked_whole(
        service: TinkerService, client: Callable[[str], tinker.ServiceClient]) -> None:
    """Sampler weights are 0600 files in 0700 directories; a trailing newline in a name is refused (no ``ok\\n``)."""
    tc = client("dave").create_lora_training_client(base_model="rota/tiny", rank=2, seed=4).result(timeout=TIMEOUT)
    tc.forward_backward(batch(0, seed=4), "cross_entropy").result(timeout=TIMEOUT)
    path = tc.save_weights_for_sampler("ok").result(timeout=TIMEOUT).path
    saved = service.state.weights[path].file
    assert saved.endswith("/sampler_weights/ok") and os.listdir(saved)
    for name in os.listdir(saved):
        assert _mode(os.path.join(saved, name)) == 0o600, name
    folder = os.path.dirname(saved)
    for d in (saved, folder, os.path.dirname(folder), os.path.dirname(os.path.dirname(folder)),
              service.config.data_dir):
        assert _mode(d) == 0o700, d
    r = httpx.post(f"{service.url}/api/v1/save_weights_for_sampler", headers={"X-API-Key": KEYS["dave"]},
                   json={"model_id": tc.model_id, "path": "ok\n"}, timeout=30)
    assert r.status_code == 400 and "checkpoint name" in r.json()["detail"]
    assert sorted(os.listdir(folder)) == ["ok"]


def test_ephemeral_weights_are_bounded_and_deleted_weights_free_their_bytes(
        service: TinkerService, client: Callable[[str], tinker.ServiceClient]) -> None:
    """An RL loop saves ephemeral weights every step: only the newest few stay on disk; deleting a checkpoint
    through the SDK removes its files and gives its bytes back."""
    sc = client("carol")
    tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=6).result(timeout=TIMEOUT)
    samplers = [tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT) for _ in range(EPHEMERAL_KEEP + 2)]
    folder = os.path.join(service.config.data_dir, "carol", tc.model_id, "sampler_weights")
    assert len([f for f in os.listdir(folder) if f.startswith("ephemeral-")]) == EPHEMERAL_KEEP
    prompt = tinker.types.ModelInput.from_ints([1, 2, 3])
    params = tinker.types.SamplingParams(max_tokens=2, seed=1)
    assert samplers[-1].sample(prompt, 1, params).result(timeout=TIMEOUT).sequences
    with pytest.raises(tinker.NotFoundError):
        samplers[0].sample(prompt, 1, params).result(timeout=TIMEOUT)
    held = service.usage("carol")["bytes"]
    path = tc.save_weights_for_sampler("keep").result(timeout=TIMEOUT).path
    assert service.usage("carol")["bytes"] > held
    rest = tinker.RestClient(base_url=service.url, api_key=KEYS["carol"])
    rest.delete_checkpoint_from_tinker_path(path).result(timeout=TIMEOUT)
    assert not os.path.exists(os.path.join(folder, "keep")) and service.usage("carol")["bytes"] == held
