"""StableReinforce's provenance against callers that lie (issue 34): a datum names the sampled sequences its tokens
came from, and the loss then reads the sampler's logprobs the service recorded for them. A tenant naming another
tenant's sequence, or claiming tokens a sequence never produced, is refused (400) and the model does not change."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from rota.orchestrator import OrchestratorConfig  # noqa: E402
from rota.testing import running_orchestrator  # noqa: E402
from rota_tinker import DEFAULT_BASE_MODELS, ServiceConfig, Tenant, TinkerService  # noqa: E402

KEYS = {  # 128 random bits and more: the service refuses guessable keys
    "alice": "tml-jmiRItI-6-5UbtgMNh_ZpyKCRrjvozb9a6_xJECuKgk",
    "mallory": "tml-TpVpiWjxan7hP7dPwgPteLdCg7sh-zHMm9KzcQ9_xow",
}
TIMEOUT = 120
PROMPT = [5, 9, 17, 33, 2, 8]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with running_orchestrator(OrchestratorConfig(ttl_s=10.0, park_timeout_s=60.0)) as (endpoint, _engine):
        config = ServiceConfig(tenants=tuple(Tenant(n, k) for n, k in KEYS.items()), endpoint=endpoint,
                               data_dir=str(tmp_path_factory.mktemp("provenance")), group="tinker-provenance",
                               long_poll_s=2.0, base_models=DEFAULT_BASE_MODELS)
        with TinkerService(config) as svc:
            yield svc


def _datum(seq: types.SampledSequence, tokens: list[int] | None = None) -> types.Datum:
    sampled = list(seq.tokens) if tokens is None else tokens
    n = len(PROMPT) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(PROMPT + sampled[:-1]), loss_fn_inputs={
        "target_tokens": np.asarray([0] * n + sampled, np.int64),
        "advantages": np.asarray([0.0] * n + [1.0] * len(sampled), np.float32)}).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(PROMPT)),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=n),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled))])


def _sampled(tc: tinker.TrainingClient) -> types.SampledSequence:
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result(timeout=TIMEOUT)
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=1, stop=[])
    return sampler.sample(types.ModelInput.from_ints(PROMPT), 1, params).result(timeout=TIMEOUT).sequences[0]


def test_another_tenants_or_forged_provenance_is_refused_and_changes_nothing(service: TinkerService) -> None:
    alice = tinker.ServiceClient(base_url=service.url, api_key=KEYS["alice"]).create_lora_training_client(
        base_model="rota/tiny", rank=2, seed=1).result(timeout=TIMEOUT)
    mallory = tinker.ServiceClient(base_url=service.url, api_key=KEYS["mallory"]).create_lora_training_client(
        base_model="rota/tiny", rank=2, seed=1).result(timeout=TIMEOUT)
    victim, own = _sampled(alice), _sampled(mallory)

    def loss(tc: tinker.TrainingClient, seq: types.SampledSequence) -> float:
        return tc.forward([_datum(seq)], "stable_reinforce").result(timeout=TIMEOUT).metrics["loss:sum"]

    before = loss(mallory, own)
    with pytest.raises(tinker.BadRequestError, match="no stability record"):  # alice's id: unknown to mallory
        mallory.forward_backward([_datum(victim)], "stable_reinforce").result(timeout=TIMEOUT)
    forged = [(t + 1) % 128 for t in own.tokens]  # tokens mallory's sequence never produced, its real id
    with pytest.raises(tinker.BadRequestError, match="as they were sampled"):
        mallory.forward_backward([_datum(own, forged)], "stable_reinforce").result(timeout=TIMEOUT)
    mallory.optim_step(types.AdamParams(learning_rate=1e-1)).result(timeout=TIMEOUT)  # no gradient came in
    assert loss(mallory, own) == before
    assert np.isfinite(loss(alice, victim))  # alice's record is still hers and usable
