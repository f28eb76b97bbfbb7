"""The batched LoRA worker (``--lora-batch``): every tenant's LoRA models on one shared base, trained in batched passes.

Everything is real: a rota orchestrator on loopback, spawned worker processes (the base holder, the batched worker,
tenants' samplers), a tiny Qwen3 snapshot written with ``save_pretrained``, and the official SDK. What must hold:
the units of several tenants queued while another tenant holds the device run as one batched pass in one turn;
each tenant's losses are those of the same run on the trainer processes (peft, one tenant at a time) within the
dtype's tolerance; sampler weights are the trainers' files (the tenant's sampler gives the same greedy sample);
a checkpoint resumes with its AdamW state; one tenant's model ids are nobody else's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker
from tinker import types
from tinker_testlib import KEYS, concurrently, held_back, serving_hf_models

from rota_tinker.testing import hf_snapshot

QWEN = "acme/Qwen3-Tiny"
TIMEOUT = 180
SEEDS = {"bob": 31, "carol": 32, "dave": 33}
RANKS = {"bob": 4, "carol": 8, "dave": 4}
TOLERANCE = 1e-4  # relative; fp32 on CPU: the batched pass pads rows and groups them differently (measured ~1e-6)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("batch-models")
    hf_snapshot(root / "acme" / "Qwen3-Tiny", seed=7)
    return root


@pytest.fixture(scope="module")
def batched(models: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    with serving_hf_models([str(models)], str(tmp_path_factory.mktemp("data")), "tinker-batch",
                           lora_batch=True, lora_batch_tokens=24) as svc:  # a 33-token unit runs in two parts
        yield svc


def data(step: int, seed: int, n: int = 3, length: int = 10) -> list[types.Datum]:
    import numpy as np

    rng = np.random.default_rng(1000 * seed + step)
    out = []
    for i in range(n):
        toks = rng.integers(0, 200, size=length + 1 + i).tolist()  # lengths differ: rows get padded
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]),
                               loss_fn_inputs={"target_tokens": toks[1:],
                                               "weights": [1.0] * (len(toks) - 1)}))
    return out


def steps(sc: tinker.ServiceClient, tenant: str, n: int = 3, tc: Any = None) -> tuple[list[float], Any]:
    tc = tc or sc.create_lora_training_client(base_model=QWEN, rank=RANKS[tenant], seed=SEEDS[tenant]).result(
        timeout=TIMEOUT)
    losses = []
    for step in range(n):
        fb = tc.forward_backward(data(step, SEEDS[tenant]), "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        losses.append(fb.result(timeout=TIMEOUT).metrics["loss:sum"])
        op.result(timeout=TIMEOUT)
    return losses, tc


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b, strict=True))


def test_queued_units_of_three_tenants_run_as_one_pass_in_one_turn(batched: Any) -> None:
    sc = {t: tinker.ServiceClient(base_url=batched.url, api_key=KEYS[t]) for t in SEEDS}
    tcs = concurrently({t: (lambda t=t: sc[t].create_lora_training_client(
        base_model=QWEN, rank=RANKS[t], seed=SEEDS[t]).result(timeout=TIMEOUT)) for t in SEEDS})
    _, units = held_back(batched, "tinker-batch", "ForwardBackward", lambda: {
        t: tcs[t].forward_backward(data(0, SEEDS[t]), "cross_entropy") for t in SEEDS})
    assert len(units) == 3 and {u["batch_units"] for u in units} == {3.0}, units
    assert sum(u["new_turn"] for u in units) == 1.0  # one turn of the batched worker for all three
    assert set(batched.state.batchers) == {QWEN} and batched.state.batchers[QWEN].pid is not None


def test_losses_and_samples_equal_the_trainer_processes_and_checkpoints_resume(batched: Any, models: Path,
                                                                             tmp_path: Path) -> None:
    sc = {t: tinker.ServiceClient(base_url=batched.url, api_key=KEYS[t]) for t in SEEDS}
    together = concurrently({t: (lambda t=t: steps(sc[t], t)) for t in SEEDS})
    saved = together["bob"][1].save_state("after3").result(timeout=TIMEOUT).path
    sampler = together["bob"][1].save_weights_and_get_sampling_client("bob-w")
    prompt = types.ModelInput.from_ints([5, 6, 7])
    params = types.SamplingParams(max_tokens=6, temperature=0.0)
    batched_sample = sampler.sample(prompt, 1, params).result(timeout=TIMEOUT).sequences[0].tokens
    continued = steps(sc["bob"], "bob", n=2, tc=together["bob"][1])[0]
    with serving_hf_models([str(models)], str(tmp_path), "tinker-unbatched") as plain:
        sc2 = {t: tinker.ServiceClient(base_url=plain.url, api_key=KEYS[t]) for t in SEEDS}
        alone = {t: steps(sc2[t], t) for t in SEEDS}
        worst = max(_rel(together[t][0], alone[t][0]) for t in SEEDS)
        print(f"worst relative loss difference, batched vs trainer processes: {worst:.2e}")
        assert worst <= TOLERANCE, (together, alone)
        assert len({tuple(v[0]) for v in together.values()}) == 3  # three different runs
        # the plain service's own sampler weights give the same greedy sample as the batched worker's files
        plain_sampler = alone["bob"][1].save_weights_and_get_sampling_client("bob-w")
        assert plain_sampler.sample(prompt, 1, params).result(timeout=TIMEOUT).sequences[0].tokens == batched_sample
    # the batched worker's checkpoint (adapters + AdamW state) continues as the uninterrupted run did
    back = sc["bob"].create_training_client_from_state_with_optimizer(saved)
    assert _rel(steps(sc["bob"], "bob", n=2, tc=back)[0], continued) <= TOLERANCE


def test_another_tenant_cannot_reach_a_batched_model(batched: Any) -> None:
    """The batched worker holds every tenant's models: the service checks the owner before a unit goes there."""
    import httpx

    _, tc = steps(tinker.ServiceClient(base_url=batched.url, api_key=KEYS["bob"]), "bob", n=1)
    before = [u for u in batched.unit_timings() if u["kind"] == "OptimStep"]
    for route, body in (("optim_step", {"model_id": tc.model_id, "adam_params": {"learning_rate": 1.0}}),
                        ("save_weights", {"model_id": tc.model_id, "path": "stolen"}),
                        ("unload_model", {"model_id": tc.model_id})):
        r = httpx.post(f"{batched.url}/api/v1/{route}", headers={"X-API-Key": KEYS["alice"]}, json=body, timeout=30)
        assert r.status_code == 403, (route, r.status_code, r.text)
    assert [u for u in batched.unit_timings() if u["kind"] == "OptimStep"] == before  # nothing reached the worker
    assert steps(tinker.ServiceClient(base_url=batched.url, api_key=KEYS["bob"]), "bob", n=1, tc=tc)[0]


def test_samples_of_several_tenants_decode_as_one_batch(batched: Any, models: Path, tmp_path: Path) -> None:
    """Samples from two tenants' LoRA sampler weights and from the bare base, held back together, decode in the
    batched worker as one batch (each row with its own adapters), and equal the same samples from the tenants'
    sampler processes of a service without --lora-batch."""
    prompt = types.ModelInput.from_ints([5, 6, 7, 8])
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    samplers = {}
    for t in ("bob", "carol"):
        sc = tinker.ServiceClient(base_url=batched.url, api_key=KEYS[t])
        _, tc = steps(sc, t, n=1)
        samplers[t] = tc.save_weights_and_get_sampling_client(f"{t}-s")
    samplers["dave"] = tinker.ServiceClient(base_url=batched.url, api_key=KEYS["dave"]).create_sampling_client(
        base_model=QWEN)
    results, units = held_back(batched, "tinker-batch", "Sample", lambda: {
        t: s.sample(prompt, 2, params) for t, s in samplers.items()})
    together = {t: [s.tokens for s in r.sequences] for t, r in results.items()}
    assert len(units) == 3 and {u["batch_units"] for u in units} == {3.0}, units
    assert {u["decode_rows"] for u in units} == {6.0}
    with serving_hf_models([str(models)], str(tmp_path), "tinker-unbatched-samples") as plain:
        alone = {}
        for t in ("bob", "carol"):
            sc = tinker.ServiceClient(base_url=plain.url, api_key=KEYS[t])
            _, tc = steps(sc, t, n=1)
            alone[t] = [s.tokens for s in tc.save_weights_and_get_sampling_client(f"{t}-s").sample(
                prompt, 2, params).result(timeout=TIMEOUT).sequences]
        alone["dave"] = [s.tokens for s in tinker.ServiceClient(base_url=plain.url, api_key=KEYS["dave"])
                         .create_sampling_client(base_model=QWEN).sample(prompt, 2, params).result(timeout=TIMEOUT)
                         .sequences]
    assert together == alone
