"""StableReinforce (``stable_reinforce``) and ``record_stability_info``: a tiny Qwen3 served from a hub cache, driven
by the real tinker SDK. Samples recorded at sampling time, provenance checked against them, the loss's value and
gradient against its formula (:func:`rota_tinker._worker.models.stable_reinforce`, the service README's definition)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker_testlib import KEYS, serving_hf_models

from rota_tinker import TinkerService
from rota_tinker._worker.models import stable_reinforce
from rota_tinker.testing import hub_cache_snapshot

TIMEOUT = 180
QWEN = "acme/Qwen3-Tiny"
PROMPT = "hello world, stop here. the quick brown fox"


def formula(lp: np.ndarray, q: np.ndarray, adv: np.ndarray, mask: np.ndarray, kl: float) -> float:
    """The README's StableReinforce, in numpy: -sum A min(r, 1) log p + kl sum (r - 1 - log r) on sampled rows."""
    on = mask != 0
    r = np.exp(lp[on] - q[on])
    return float(-(np.minimum(r, 1.0) * lp[on] * adv[on]).sum() + kl * (r - 1 - np.log(r)).sum())


def test_value_and_gradient_follow_the_formula() -> None:
    rng = np.random.default_rng(0)
    n = 12
    lp = torch.tensor(rng.normal(-3.0, 1.0, n), dtype=torch.float64, requires_grad=True)
    q = torch.tensor(lp.detach().numpy() + rng.normal(0.0, 0.5, n))  # ratios both sides of 1
    adv = torch.tensor(rng.normal(0.0, 1.0, n))
    mask = torch.tensor((np.arange(n) >= 4).astype(np.float64))  # 4 prompt rows, then sampled ones
    loss = stable_reinforce(lp, q, adv, mask, 0.3)
    loss.backward()
    value = formula(lp.detach().numpy(), q.numpy(), adv.numpy(), mask.numpy(), 0.3)
    assert float(loss.detach()) == pytest.approx(value, rel=1e-12)
    r = torch.exp(lp.detach() - q)
    want = torch.where(mask != 0, -adv * torch.clamp(r, max=1.0) + 0.3 * (r - 1), torch.zeros(n))
    torch.testing.assert_close(lp.grad, want, rtol=1e-12, atol=1e-12)
    assert bool((r[4:] > 1).any()) and bool((r[4:] < 1).any())  # both the truncated and the weighted side ran


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    root = tmp_path_factory.mktemp("sr")
    hub_cache_snapshot(root / "cache", QWEN, seed=1)
    with serving_hf_models([str(root / "cache")], str(root / "data"), "tinker-sr") as svc:
        yield svc


def _ids(service: TinkerService) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(service.config.base_models[QWEN].path).encode(PROMPT)


def _datum(prompt: list[int], seq: types.SampledSequence, adv: float, sequence_id: str | None = None,
           ) -> types.Datum:
    """The cookbook's rl_loop datum: prompt + sampled tokens, advantages on the sampled rows, its provenance."""
    sid = sequence_id or seq.sequence_id
    tokens = list(seq.tokens)
    n_in = len(prompt) + len(tokens) - 1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(prompt[1:] + tokens, np.int64),
                        "logprobs": np.asarray([0.0] * (len(prompt) - 1) + list(seq.logprobs), np.float32),
                        "advantages": np.asarray([0.0] * (len(prompt) - 1) + [adv] * len(tokens), np.float32)})
    assert datum.model_input.length == n_in
    return datum.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=sid, length=len(tokens))])


def _sample(tc: tinker.TrainingClient, prompt: list[int], record: bool = True) -> list[types.SampledSequence]:
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=record).result(timeout=TIMEOUT)
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])
    out = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result(timeout=TIMEOUT)
    assert all(len(s.tokens) == 6 and s.sequence_id for s in out.sequences)
    return out.sequences


def test_recorded_samples_train_with_the_formula_and_its_gradient(service: TinkerService) -> None:
    """Sample with record_stability_info, take a step so the learner moves off the sampler, then: the reported loss
    is the formula of the learner's logprobs and the sampler's recorded ones, and a step on it moves the weights as a
    step on the same formula computed by the client (forward_backward_custom) does."""
    prompt = _ids(service)
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEYS["alice"])
    tcs = [sc.create_lora_training_client(base_model=QWEN, rank=2, seed=5).result(timeout=TIMEOUT) for _ in range(2)]
    seqs = _sample(tcs[0], prompt)
    data = [_datum(prompt, s, a) for s, a in zip(seqs, (1.0, -0.5), strict=True)]
    moved = types.Datum(model_input=data[0].model_input, loss_fn_inputs={
        "target_tokens": data[0].loss_fn_inputs["target_tokens"],
        "weights": np.ones(data[0].model_input.length, np.float32)})
    for tc in tcs:  # both off the sampler the same way
        tc.forward_backward([moved], "cross_entropy").result(timeout=TIMEOUT)
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT)
    lps = [np.asarray(o["logprobs"].tolist(), np.float64) for o in
           tcs[0].forward(data, "stable_reinforce", {"kl_coeff": 0.2}).result(timeout=TIMEOUT).loss_fn_outputs]
    n_prompt = len(prompt) - 1
    expect, ratios = 0.0, []
    for d, lp, seq in zip(data, lps, seqs, strict=True):
        q = np.asarray([0.0] * n_prompt + list(seq.logprobs), np.float64)
        mask = np.asarray([0.0] * n_prompt + [1.0] * len(seq.tokens))
        expect += formula(lp, q, d.loss_fn_inputs["advantages"].to_numpy().astype(np.float64), mask, 0.2)
        ratios += list(np.exp(lp[n_prompt:] - q[n_prompt:]))
    assert not np.allclose(ratios, 1.0, atol=1e-3)  # off-policy: the weights are not all 1
    out = tcs[0].forward_backward(data, "stable_reinforce", {"kl_coeff": 0.2}).result(timeout=TIMEOUT)
    assert out.metrics["loss:sum"] == pytest.approx(expect, rel=1e-4)

    def twin(ds: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        total = torch.zeros((), dtype=torch.float64)
        for d, lp, seq in zip(ds, logprobs, seqs, strict=True):
            q = torch.tensor([0.0] * n_prompt + list(seq.logprobs), dtype=torch.float64)
            mask = torch.tensor([0.0] * n_prompt + [1.0] * len(seq.tokens), dtype=torch.float64)
            adv = torch.tensor(d.loss_fn_inputs["advantages"].to_numpy(), dtype=torch.float64)
            total = total + stable_reinforce(lp.double(), q, adv, mask, 0.2)
        return total, {}

    tcs[1].forward_backward_custom(data, twin).result(timeout=TIMEOUT)
    for tc in tcs:
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)
    after = [np.asarray(tc.forward([moved], "cross_entropy").result(timeout=TIMEOUT).loss_fn_outputs[0]["logprobs"]
                        .tolist()) for tc in tcs]
    before = lps[0]
    assert not np.allclose(after[0], before, atol=1e-4)  # the step moved the model
    np.testing.assert_allclose(after[0], after[1], rtol=0, atol=2e-4)


def test_provenance_is_checked_against_the_records(service: TinkerService) -> None:
    """Each claim is checked: unknown, unrecorded or another tenant's or session's sequences, tokens that are not the
    recorded ones, advantages on prompt rows and data without provenance are 400s naming the problem."""
    prompt = _ids(service)
    alice = tinker.ServiceClient(base_url=service.url, api_key=KEYS["alice"])
    tc = alice.create_lora_training_client(base_model=QWEN, rank=2, seed=1).result(timeout=TIMEOUT)
    seq = _sample(tc, prompt)[0]
    unrecorded = _sample(tc, prompt, record=False)[0]
    good = _datum(prompt, seq, 1.0)
    assert np.isfinite(tc.forward([good], "stable_reinforce").result(timeout=TIMEOUT).metrics["loss:sum"])

    def refused(d: types.Datum, match: str, client: tinker.TrainingClient = tc) -> None:
        with pytest.raises(tinker.BadRequestError, match=match):
            client.forward([d], "stable_reinforce").result(timeout=30)

    refused(types.Datum(model_input=good.model_input, loss_fn_inputs=good.loss_fn_inputs), "has no provenance")
    refused(_datum(prompt, seq, 1.0, sequence_id="made-up"), "no stability record")
    refused(_datum(prompt, unrecorded, 1.0), "no stability record")
    forged = types.SampledSequence(stop_reason=seq.stop_reason, sequence_id=seq.sequence_id,
                                   tokens_np=np.asarray([(t + 1) % 50 for t in seq.tokens], np.int32),
                                   logprobs_np=np.asarray(seq.logprobs, np.float32))
    refused(_datum(prompt, forged, 1.0), "provenance must name the tokens as they were sampled")
    prompt_adv = good.loss_fn_inputs["advantages"].to_numpy().copy()
    prompt_adv[0] = 1.0
    refused(types.Datum(model_input=good.model_input,
                        loss_fn_inputs={**good.loss_fn_inputs, "advantages": prompt_adv}).with_provenance(
                            good.model_input_spans, good.loss_fn_input_spans), "on a prompt token")
    # the same sequence id from another session of the same tenant, and from another tenant
    other_session = tinker.ServiceClient(base_url=service.url, api_key=KEYS["alice"])
    refused(good, "no stability record",
            other_session.create_lora_training_client(base_model=QWEN, rank=2).result(timeout=TIMEOUT))
    bob = tinker.ServiceClient(base_url=service.url, api_key=KEYS["bob"])
    refused(good, "no stability record", bob.create_lora_training_client(base_model=QWEN, rank=2).result(
        timeout=TIMEOUT))
    assert service.state.stability.count("alice") >= 2 and service.state.stability.count("bob") == 0
    with pytest.raises(tinker.BadRequestError, match="loss_fn_config key 'beta'"):
        tc.forward([good], "stable_reinforce", {"beta": 1.0}).result(timeout=30)


def test_records_end_with_their_session(service: TinkerService, tmp_path: Path) -> None:
    prompt = _ids(service)
    sc = tinker.ServiceClient(base_url=service.url, api_key=KEYS["carol"])
    tc = sc.create_lora_training_client(base_model=QWEN, rank=2).result(timeout=TIMEOUT)
    _sample(tc, prompt)
    assert service.state.stability.count("carol") == 2
    service.state.end_session(sc.holder.get_session_id(), "test")
    assert service.state.stability.count("carol") == 0
