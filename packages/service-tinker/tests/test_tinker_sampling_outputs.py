"""What a sample request may ask for besides its samples, through the real tinker SDK on a tiny Qwen3 folder, checked
against a transformers forward of the same weights: top-k prompt and sample logprobs (k = 100), the logprobs of
chosen target ids at each prompt position, alternative prompt tokens, and ``prompt_logprobs_last_n``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker_testlib import KEYS, serving_hf_models

from rota_tinker import TinkerService
from rota_tinker.testing import hf_snapshot

QWEN = "acme/Qwen3-Tiny"
TIMEOUT = 180
PROMPT = [17, 42, 99, 5, 230, 61, 7, 150]
K = 100
ATOL = 2e-5  # the service's CPU forward (batched, KV cache) vs one plain forward: same math, other kernels


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_snapshot(tmp_path_factory.mktemp("outputs") / "models" / "acme" / "Qwen3-Tiny", seed=4)


@pytest.fixture(scope="module")
def svc(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    with serving_hf_models([str(folder.parents[1])], str(tmp_path_factory.mktemp("data")), "tinker-outputs") as s:
        yield s


@pytest.fixture(scope="module")
def sampler(svc: TinkerService) -> tinker.SamplingClient:
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])
    return sc.create_sampling_client(base_model=QWEN).result(timeout=TIMEOUT)


@pytest.fixture(scope="module")
def reference(folder: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def logprobs_of(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]``: row ``i`` is the distribution of the token after ``tokens[:i + 1]``."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0].float(), dim=-1)


def test_topk_prompt_and_sample_logprobs_equal_a_transformers_forward(sampler: tinker.SamplingClient,
                                                                     reference: torch.nn.Module) -> None:
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=5, seed=3),
                         include_prompt_logprobs=True, topk_prompt_logprobs=K,
                         topk_sample_logprobs=K).result(timeout=TIMEOUT)
    ref = logprobs_of(reference, PROMPT)
    topk = res.topk_prompt_logprobs
    assert topk is not None and len(topk) == len(PROMPT) and topk[0] is None  # nothing predicts the first token
    for pos in range(1, len(PROMPT)):
        want_vals = torch.topk(ref[pos - 1], K).values
        got_ids = [t for t, _ in topk[pos]]
        got_vals = np.array([lp for _, lp in topk[pos]])
        assert len(topk[pos]) == K
        np.testing.assert_allclose(got_vals, want_vals.numpy(), atol=ATOL)
        assert np.all(np.diff(got_vals) <= 0)  # best first
        np.testing.assert_allclose(ref[pos - 1, got_ids].numpy(), got_vals, atol=ATOL)  # each id has its value
    for seq in res.sequences:
        full = PROMPT + list(seq.tokens)
        ref_full = logprobs_of(reference, full)
        assert seq.topk_logprobs is not None and len(seq.topk_logprobs) == len(seq.tokens)
        for i, (tok, row) in enumerate(zip(seq.tokens, seq.topk_logprobs, strict=True)):
            dist = ref_full[len(PROMPT) - 1 + i]
            np.testing.assert_allclose([lp for _, lp in row], torch.topk(dist, K).values.numpy(), atol=ATOL)
            np.testing.assert_allclose(dist[[t for t, _ in row]].numpy(), [lp for _, lp in row], atol=ATOL)
            assert abs(float(dist[tok]) - seq.logprobs[i]) < ATOL


def test_prompt_logprobs_last_n_scores_only_the_suffix(sampler: tinker.SamplingClient,
                                                      reference: torch.nn.Module) -> None:
    ref = logprobs_of(reference, PROMPT)
    want = [float(ref[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    whole = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(timeout=TIMEOUT)
    assert whole[0] is None
    np.testing.assert_allclose(whole[1:], want, atol=ATOL)
    last3 = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT),
                                     prompt_logprobs_last_n=3).result(timeout=TIMEOUT)
    assert last3[:-3] == [None] * (len(PROMPT) - 3)
    np.testing.assert_allclose(last3[-3:], want[-3:], atol=ATOL)
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, seed=1),
                         include_prompt_logprobs=True, topk_prompt_logprobs=4,
                         prompt_logprobs_last_n=2).result(timeout=TIMEOUT)
    assert res.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    np.testing.assert_allclose([lp for _, lp in res.topk_prompt_logprobs[-1]],
                               torch.topk(ref[len(PROMPT) - 2], 4).values.numpy(), atol=ATOL)


def test_target_prompt_logprobs_and_alternative_tokens(sampler: tinker.SamplingClient,
                                                      reference: torch.nn.Module) -> None:
    ref = logprobs_of(reference, PROMPT)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 300, size=(len(PROMPT) - 1, 3)).astype(np.int64)
    ids[2, 1] = -1  # nothing asked in this cell
    res = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, seed=2),
                         target_prompt_logprobs=types.TensorData.from_numpy(ids),
                         prompt_alt_tokens_k=6).result(timeout=TIMEOUT)
    got = res.target_prompt_logprobs.to_numpy()
    want = torch.gather(ref[:-1], 1, torch.as_tensor(ids).clamp(min=0)).numpy()
    want[2, 1] = 0.0
    assert got.shape == ids.shape
    np.testing.assert_allclose(got, want, atol=ATOL)
    alt_toks = res.prompt_alt_tokens.tokens.to_numpy()
    alt_lps = res.prompt_alt_tokens.logprobs.to_numpy()
    assert alt_toks.shape == alt_lps.shape == (len(PROMPT) - 1, 6)
    np.testing.assert_allclose(alt_lps, torch.gather(ref[:-1], 1, torch.as_tensor(alt_toks)).numpy(), atol=ATOL)
    assert len({tuple(r) for r in alt_toks}) > 1  # draws, not one constant row
    greedy = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, temperature=0),
                            prompt_alt_tokens_k=2).result(timeout=TIMEOUT)
    assert (greedy.prompt_alt_tokens.tokens.to_numpy() == ref[:-1].argmax(-1, keepdim=True).numpy()).all()
    again = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1, seed=2),
                           prompt_alt_tokens_k=6).result(timeout=TIMEOUT)
    assert (again.prompt_alt_tokens.tokens.to_numpy() == alt_toks).all()  # seeded
    assert list(again.sequences[0].tokens) == list(res.sequences[0].tokens)  # the draws leave the sample alone


def test_bad_output_requests_are_refused_naming_the_field(svc: TinkerService) -> None:
    key = {"X-API-Key": KEYS["alice"]}

    def asample(**extra: object) -> httpx.Response:
        return httpx.post(f"{svc.url}/api/v1/asample", headers=key, timeout=30, json={
            "base_model": QWEN, "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
            "sampling_params": {}, **extra})

    for extra, named in (({"topk_prompt_logprobs": 1001}, "topk_prompt_logprobs"),
                         ({"topk_sample_logprobs": -1}, "topk_sample_logprobs"),
                         ({"prompt_logprobs_last_n": 3}, "prompt_logprobs_last_n"),
                         ({"prompt_logprobs": True, "prompt_logprobs_last_n": len(PROMPT)}, "prompt_logprobs_last_n"),
                         ({"target_prompt_logprobs": {"data": [1, 2], "dtype": "int64", "shape": [1, 2]}}, "shape"),
                         ({"target_prompt_logprobs": {"data": [300] * 7, "dtype": "int64", "shape": [7, 1]}},
                          "vocabulary"),
                         ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "shape": [7, 1],
                                                      "sparse_crow_indices": [0, 1], "sparse_col_indices": [0]}},
                          "sparse CSR")):
        r = asample(**extra)
        assert r.status_code == 400 and named in r.json()["detail"], (extra, r.text)
