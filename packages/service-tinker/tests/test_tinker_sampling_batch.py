"""Sampling batched across the requests of one turn: sample requests queued at a tenant's sampler decode together
(one batch per weights), each with its own parameters and seed, each answered as if it had run alone.

Numbers: on this CPU a row's logits in a batch are not bit-identical to the same row alone (the batched matmuls
sum in another order; measured differences are about 1e-6 in logprobs), so logprobs are compared with
``atol=1e-5``; the sampled tokens and stop reasons of these seeded requests are compared exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
from tinker import types
from tinker_testlib import KEYS, await_queued, serving_hf_models

import rota
from rota_tinker import TinkerService
from rota_tinker.testing import hub_cache_snapshot

TIMEOUT = 180
QWEN = "acme/Qwen3-Tiny"


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinkerService]:
    cache = tmp_path_factory.mktemp("hf-cache")
    hub_cache_snapshot(cache, QWEN, seed=1)
    with serving_hf_models([str(cache)], str(tmp_path_factory.mktemp("data")), "tinker-batch",
                           units_per_turn=16) as service:
        yield service


def _tokenizer(service: TinkerService) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(service.config.base_models[QWEN].path)


def _one_turn(service: TinkerService, tenant: str, calls: list[Callable[[], Any]]) -> list[Any]:
    """Send every call at once while another rota tenant holds the group, so all are queued at the sampler when it
    gets its turn; their results."""
    blocker = rota.connect(group=service.config.group, tenant="blocker", endpoint=service.config.endpoint)
    try:
        blocker.acquire()
        with service.state.lock:
            since = len(service.state.futures)
        futures = [call() for call in calls]
        await_queued(service, tenant, ["Sample"] * len(calls), since, TIMEOUT)
        blocker.release()
        return [f.result(timeout=TIMEOUT) for f in futures]
    finally:
        blocker.close()


def _sample_units(service: TinkerService, tenant: str, since: float) -> list[dict[str, Any]]:
    return [u for u in service.unit_timings() if u["tenant"] == tenant and u["kind"] == "Sample"
            and u["submitted"] > since]


def test_requests_of_one_turn_decode_as_one_batch_each_as_alone(svc: TinkerService, tmp_path: Path) -> None:
    """Nine requests (two weights: the base and a trained LoRA adapter; prompts of four lengths; greedy and
    temperatures 0.7-1.5, top-k, top-p; max_tokens 3-16; a stop string, a stop token, the implicit end of sequence,
    none; 1-3 samples; compute_logprobs) queued in one turn run as one batch, and each gets what it gets alone:
    the same tokens and stop reasons, logprobs and prompt logprobs within 1e-5, each row ending at its own stop."""
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])
    tok = _tokenizer(svc)
    tc = sc.create_lora_training_client(base_model=QWEN, rank=2, seed=1).result(timeout=TIMEOUT)
    ids = tok.encode("the quick brown fox jumps over the lazy dog.")
    data = [types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": np.asarray(ids[1:], np.int64)})]
    tc.forward_backward(data, "cross_entropy").result(timeout=TIMEOUT)
    tc.optim_step(types.AdamParams(learning_rate=5e-2)).result(timeout=TIMEOUT)  # adapters no longer zero
    tuned = tc.save_weights_and_get_sampling_client().result(timeout=TIMEOUT)
    base = sc.create_sampling_client(base_model=QWEN).result(timeout=TIMEOUT)
    prompts = [types.ModelInput.from_ints(tok.encode(t)) for t in
               ("hello", "the quick brown fox", "user: hi there\nassistant:", "a")]
    free = base.sample(prompts[1], 1, types.SamplingParams(max_tokens=12, seed=7, stop=[])).result(timeout=TIMEOUT)
    toks = list(free.sequences[0].tokens)
    stop_text = tok.decode(toks[:5])[-3:]  # a string the seeded sample produces by its 5th token
    text_end = next(i for i in range(1, 13) if stop_text in tok.decode(toks[:i]))
    stop_token = toks[3]
    token_end = toks.index(stop_token) + 1
    calls: list[Callable[[], Any]] = [
        lambda: base.sample(prompts[0], 2, types.SamplingParams(max_tokens=10, seed=1, temperature=0.7, stop=[])),
        lambda: base.sample(prompts[1], 1, types.SamplingParams(max_tokens=12, seed=7, stop=stop_text)),
        lambda: base.sample(prompts[1], 1, types.SamplingParams(max_tokens=12, seed=7, stop=[stop_token])),
        lambda: base.sample(prompts[2], 3, types.SamplingParams(max_tokens=3, seed=2, temperature=1.5, top_k=20,
                                                                stop=[])),
        lambda: base.sample(prompts[3], 1, types.SamplingParams(max_tokens=16, seed=3, temperature=0.0)),
        lambda: base.sample(prompts[2], 1, types.SamplingParams(max_tokens=6, seed=4, top_p=0.8, stop=[])),
        lambda: base.compute_logprobs(prompts[2]),
        lambda: tuned.sample(prompts[1], 2, types.SamplingParams(max_tokens=8, seed=7, stop=[])),
        lambda: tuned.sample(prompts[0], 1, types.SamplingParams(max_tokens=5, seed=5, temperature=0.0, stop=[])),
    ]
    start = svc.unit_timings()[-1]["answered"]
    alone = [call().result(timeout=TIMEOUT) for call in calls]
    alone_units = _sample_units(svc, "alice", start)
    start = alone_units[-1]["answered"]
    together = _one_turn(svc, "alice", calls)
    units = _sample_units(svc, "alice", start)

    # alone: each request its own decode batch of its num_samples rows; in one turn: one decode batch per weights
    # (the base's 7 requests, 10 rows; the adapter's 2 requests, 3 rows), run in one call (one shared compute_s)
    rows_of = [2, 1, 1, 3, 1, 1, 1, 2, 1]
    assert sorted((u["batch_units"], u["decode_rows"]) for u in alone_units) == sorted((1, n) for n in rows_of)
    assert sorted((u["batch_units"], u["decode_rows"]) for u in units) == [(2, 3)] * 2 + [(7, 10)] * 7
    assert sum(u["new_turn"] for u in units) == 1 and len({u["compute_s"] for u in units}) == 1
    for i, (a, b) in enumerate(zip(alone, together, strict=True)):
        if isinstance(a, list):  # compute_logprobs
            assert a[0] is None and b[0] is None
            np.testing.assert_allclose(a[1:], b[1:], rtol=0, atol=1e-5)
            continue
        assert len(a.sequences) == len(b.sequences), i
        for sa, sb in zip(a.sequences, b.sequences, strict=True):
            assert (list(sa.tokens), sa.stop_reason) == (list(sb.tokens), sb.stop_reason), i
            np.testing.assert_allclose(sa.logprobs, sb.logprobs, rtol=0, atol=1e-5)
    rows = {i: [(list(s.tokens), s.stop_reason) for s in r.sequences] for i, r in enumerate(together)
            if not isinstance(r, list)}
    assert rows[1] == [(toks[:text_end], "stop")] and rows[2] == [(toks[:token_end], "stop")]
    assert [(len(t), why) for t, why in rows[3]] == [(3, "length")] * 3
    assert all(len(t) == 10 and why == "length" for t, why in rows[0]) and rows[0][0][0] != rows[0][1][0]
    # the adapter's requests were decoded on its own weights (they differ from the base's), beside the base's
    tuned_row, base_row = together[7].sequences[0], free.sequences[0]
    assert list(tuned_row.tokens) != toks[:8] or not np.allclose(tuned_row.logprobs, base_row.logprobs[:8], atol=1e-3)


def test_prompt_logprobs_batches_keep_their_logits_bounded() -> None:
    """Prompt logprobs take logits at every prompt position of every row: a batch with them is split where rows x
    prompt width would pass the bound; batches without them are not split (their logits are one row each)."""
    from rota_tinker._worker.sampling import decode_batches

    def req(n: int, length: int, prompt_logprobs: bool = False) -> dict[str, Any]:
        return {"num_samples": n, "prompt": np.zeros(length, np.int64), "params": {"prompt_logprobs": prompt_logprobs}}

    plain = [req(4, 60), req(4, 60), req(8, 90)]
    assert decode_batches(plain, 100) == [[0, 1, 2]]
    mixed = [req(2, 10), req(1, 40, True), req(1, 5), req(1, 200, True), req(3, 20)]
    assert decode_batches(mixed, 100) == [[0], [1, 2], [3], [4]]  # 3 x 40 > 100; 2 x 40; 1 x 200 alone; 4 x 200 > 100
    assert decode_batches(mixed, 10_000) == [[0, 1, 2, 3, 4]]
