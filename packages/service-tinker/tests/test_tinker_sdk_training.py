"""Two tenants (full-parameter and LoRA) train and sample concurrently through the real tinker SDK,
and get exactly the numbers the same loops get run alone."""

from __future__ import annotations

from collections.abc import Callable

import tinker
from tinker import types
from tinker_testlib import batch, concurrently, full_training_client

STEPS = 6
TIMEOUT = 120


def loop(sc: tinker.ServiceClient, mode: str, name: str) -> tuple[list[float], list[list[int]]]:
    """forward_backward/optim_step for STEPS steps, then save for the sampler and sample: (losses, samples)."""
    if mode == "full":
        tc = full_training_client(sc, "rota/tiny")
        assert tc.get_info().is_lora is False
    else:
        tc = sc.create_lora_training_client(base_model="rota/tiny", rank=4, seed=11).result(timeout=TIMEOUT)
        assert tc.get_info().is_lora is True and tc.get_info().lora_rank == 4
    losses = []
    for step in range(STEPS):
        fb = tc.forward_backward(batch(step % 2, seed=5), "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        out = fb.result(timeout=TIMEOUT)
        op.result(timeout=TIMEOUT)
        assert len(out.loss_fn_outputs) == 2 and out.loss_fn_outputs[0]["logprobs"].shape == [12]
        losses.append(out.metrics["loss:sum"])
    path = tc.save_weights_for_sampler(name).result(timeout=TIMEOUT).path
    assert path.startswith("tinker://") and path.endswith(f"/sampler_weights/{name}")
    sampler = sc.create_sampling_client(model_path=path).result(timeout=TIMEOUT)
    res = sampler.sample(types.ModelInput.from_ints([1, 2, 3]), 2,
                         types.SamplingParams(max_tokens=6, seed=7, temperature=1.0)).result(timeout=TIMEOUT)
    samples = [list(map(int, s.tokens)) for s in res.sequences]
    assert all(len(s) == 6 for s in samples) and all(s.stop_reason == "length" for s in res.sequences)
    return losses, samples


def test_full_and_lora_tenants_concurrently_equal_alone(client: Callable[[str], tinker.ServiceClient]) -> None:
    results = concurrently({"alice": lambda: loop(client("alice"), "full", "concurrent"),
                            "bob": lambda: loop(client("bob"), "lora", "concurrent")}, timeout_s=300)

    alone_full = loop(client("alice"), "full", "alone")
    alone_lora = loop(client("bob"), "lora", "alone")
    assert results["alice"] == alone_full
    assert results["bob"] == alone_lora
    for losses, _ in (alone_full, alone_lora):
        assert losses[-2] < losses[0] and losses[-1] < losses[1]  # they trained (two batches, alternating)
    assert alone_full[0] != alone_lora[0]  # and differently: a full model is not its LoRA twin
