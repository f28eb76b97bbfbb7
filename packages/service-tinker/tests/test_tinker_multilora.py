"""Many tenants' LoRA in one batched pass on a real Hugging Face model (rota_tinker._worker.multilora).

A tiny Qwen3 written with ``save_pretrained`` and loaded with ``from_pretrained``; 32 tenants with mixed ranks,
targets, learning rates, loss functions and sequence lengths train 10 steps batched together, and each tenant
alone on its own copy of the base: losses and adapter weights agree within fp32 rounding (the batch's GEMMs have
other shapes than one tenant's). A tenant poisoned with NaN and huge values changes nothing of the others.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rota_tinker._worker.multilora import BatchedLora, Unit, _GroupedLora, plan_batches
from rota_tinker.testing import hf_snapshot

LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
TARGETS = ({"attn": True, "mlp": True, "unembed": True}, {"attn": True}, {"mlp": True, "unembed": True})
TOLERANCE = 1e-3  # relative, the aim; fp32 on this CPU measures about 1e-6 (printed below)


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_snapshot(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=5, hidden=32, layers=2)


def _base(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()


def _tenant(i: int) -> dict[str, Any]:
    return {"name": f"t{i:02d}", "rank": (4, 8, 16)[i % 3], "targets": TARGETS[i % len(TARGETS)],
            "loss_fn": LOSSES[i % len(LOSSES)], "lr": 1e-3 * (1 + i % 4), "length": 6 + i % 9, "rows": 1 + i % 3}


def _unit(t: dict[str, Any], step: int, vocab: int, poison: bool = False) -> Unit:
    rng = np.random.default_rng([int(t["name"][1:]), step])
    data = []
    for _ in range(t["rows"]):
        toks = rng.integers(0, vocab, size=t["length"] + 1)
        n = t["length"]
        ins: dict[str, Any] = {"target_tokens": toks[1:]}
        if t["loss_fn"] == "cross_entropy":
            ins["weights"] = np.full(n, np.nan, np.float32) if poison else np.ones(n, np.float32)
        else:
            ins["logprobs"] = rng.uniform(-8, -4, size=n).astype(np.float32)
            ins["advantages"] = np.full(n, 1e30 if poison else 1.0, np.float32) * rng.choice([-1, 1], size=n)
        data.append((toks[:-1], ins))
    return Unit(t["name"], data, t["loss_fn"])


def _train(folder: Path, tenants: list[dict[str, Any]], steps: int, vocab: int, together: bool,
           poisoned: str = "") -> tuple[dict[str, list[float]], dict[str, dict[str, torch.Tensor]]]:
    engines = {}
    if together:
        shared = BatchedLora(_base(folder), "cpu")
        engines = {t["name"]: shared for t in tenants}
    for t in tenants:
        engine = engines.get(t["name"]) or BatchedLora(_base(folder), "cpu")
        engines[t["name"]] = engine
        engine.add(t["name"], t["rank"], seed=int(t["name"][1:]), targets=t["targets"])
    losses: dict[str, list[float]] = {t["name"]: [] for t in tenants}
    for step in range(steps):
        units = [_unit(t, step, vocab, poison=t["name"] == poisoned) for t in tenants]
        if together:
            results = engines[tenants[0]["name"]].forward_backward(units)
        else:
            results = [engines[u.tenant].forward_backward([u])[0] for u in units]
        for t, r in zip(tenants, results, strict=True):
            losses[t["name"]].append(r["metrics"]["loss:sum"])
            engines[t["name"]].optim_step(t["name"], {"learning_rate": t["lr"], "beta1": 0.9, "beta2": 0.95,
                                                      "eps": 1e-12, "weight_decay": 0.01, "grad_clip_norm": 1.0})
    return losses, {t["name"]: engines[t["name"]].state_dict(t["name"]) for t in tenants}


def _rel(a: float | torch.Tensor, b: float | torch.Tensor) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def test_32_tenants_batched_equal_each_alone_after_10_steps(snapshot: Path) -> None:
    vocab = _base(snapshot).config.vocab_size
    tenants = [_tenant(i) for i in range(32)]
    batched, w_batched = _train(snapshot, tenants, 10, vocab, together=True)
    alone, w_alone = _train(snapshot, tenants, 10, vocab, together=False)
    worst_loss = max(_rel(x, y) for t in batched for x, y in zip(batched[t], alone[t], strict=True))
    worst_weight = max(_rel(w_batched[t][k], w_alone[t][k]) for t in w_batched for k in w_alone[t])
    print(f"worst relative difference over 32 tenants x 10 steps: losses {worst_loss:.2e}, "
          f"adapter weights {worst_weight:.2e}")
    assert worst_loss <= TOLERANCE and worst_weight <= TOLERANCE
    assert all(not torch.equal(w_alone[t][k], torch.zeros_like(w_alone[t][k])) for t in w_alone
               for k in w_alone[t] if "lora_B" in k), "some adapter never trained: the comparison shows nothing"
    # A and B of each adapted linear: 2 layers x (4 attention + 3 MLP linears) + lm_head, by target choice
    assert {len(w_alone[t]) for t in w_alone} == {2 * (2 * 7 + 1), 2 * (2 * 4), 2 * (2 * 3 + 1)}


def test_a_poisoned_tenant_changes_nothing_of_the_others(snapshot: Path) -> None:
    vocab = _base(snapshot).config.vocab_size
    tenants = [_tenant(i) for i in range(8)]
    clean, w_clean = _train(snapshot, tenants, 3, vocab, together=True)
    poisoned_ce, w_ce = _train(snapshot, tenants, 3, vocab, together=True, poisoned="t00")  # NaN loss weights
    poisoned_pg, w_pg = _train(snapshot, tenants, 3, vocab, together=True, poisoned="t01")  # 1e30 advantages
    assert all(np.isnan(x) for x in poisoned_ce["t00"]) and all(abs(x) > 1e20 for x in poisoned_pg["t01"])
    assert not any(torch.isfinite(w).all() for w in w_ce["t00"].values() if w.abs().sum() > 0)  # NaN weights
    for victim, (losses, weights) in {"t00": (poisoned_ce, w_ce), "t01": (poisoned_pg, w_pg)}.items():
        for t in clean:
            if t == victim:
                continue
            assert losses[t] == clean[t], f"{t}'s losses changed when {victim} was poisoned"
            assert all(torch.equal(weights[t][k], w_clean[t][k]) for k in w_clean[t]), t


def test_one_tenants_huge_unit_is_cut_and_nobody_waits_more_than_one_batch() -> None:
    small = [Unit(f"t{i}", [([1] * 8, {}) for _ in range(2)]) for i in range(5)]
    huge = Unit("big", [([1] * 8, {}) for _ in range(200)])  # 100x the others' units
    batches = plan_batches([huge, *small, *small], max_tenant_tokens=32, max_batch_tokens=10_000)
    assert all(sum(u.tokens() for u in b if u.tenant == "big") <= 32 for b in batches)
    assert [sorted(u.tenant for u in b if u.tenant != "big") for b in batches[:2]] == [[f"t{i}" for i in range(5)]] * 2
    assert sum(len(u.data) for b in batches for u in b if u.tenant == "big") == 200  # nothing dropped
    roomy = plan_batches([*small, huge], max_tenant_tokens=32, max_batch_tokens=6 * 32)  # tenants x their share
    assert sorted(u.tenant for u in roomy[0]) == ["big", "t0", "t1", "t2", "t3", "t4"]
    tight = plan_batches([*small, huge], max_tenant_tokens=32, max_batch_tokens=48)  # room for three small units
    firsts: dict[str, int] = {}
    for n, b in enumerate(tight):
        for u in b:
            firsts.setdefault(u.tenant, n)
    # those a full batch left out go first in the next: t3 and t4 at once, the big tenant's part right after
    assert firsts == {"t0": 0, "t1": 0, "t2": 0, "t3": 1, "t4": 1, "big": 2}, firsts
    with pytest.raises(ValueError):
        plan_batches(small, max_tenant_tokens=0, max_batch_tokens=10)


def test_adapters_are_peft_adapters(snapshot: Path) -> None:
    """A tenant's trained adapters, loaded into peft's LoRA of the same base (its own state-dict names), give the
    same logprobs: the batched pass computes peft's LoRA, and its weights leave as peft files."""
    import peft

    from rota_tinker._worker.models import LORA_ALPHA, lora_config

    vocab = _base(snapshot).config.vocab_size
    t = {**_tenant(0), "rank": 8, "targets": TARGETS[0], "loss_fn": "cross_entropy"}
    engine = BatchedLora(_base(snapshot), "cpu")
    engine.add(t["name"], 8, seed=0, targets=t["targets"])
    for step in range(2):
        engine.forward_backward([_unit(t, step, vocab)])
        engine.optim_step(t["name"], {"learning_rate": 1e-2})
    probe = _unit(t, 9, vocab)
    probe.forward_only = True
    ours = engine.forward_backward([probe])[0]["logprobs"]
    base = _base(snapshot)
    model = peft.get_peft_model(base, lora_config(base, 8, t["targets"]))
    assert model.peft_config["default"].lora_alpha == LORA_ALPHA
    result = peft.set_peft_model_state_dict(model, engine.state_dict(t["name"]))
    assert not result.unexpected_keys and not [k for k in result.missing_keys if "lora_" in k]
    with torch.no_grad():
        for (toks, ins), mine in zip(probe.data, ours, strict=True):
            logits = model(torch.as_tensor(toks)[None]).logits.float()
            lp = torch.log_softmax(logits, -1)[0].gather(1, torch.as_tensor(ins["target_tokens"])[:, None])[:, 0]
            assert _rel(torch.as_tensor(mine), lp) < 1e-5


def test_sampling_rows_of_many_tenants_decode_as_one_batch(snapshot: Path) -> None:
    """Sample requests of six tenants and one of the bare base decode as one batch, each row with its own
    adapter: every request gets the tokens it gets decoded alone (logprobs within fp32 rounding)."""
    from transformers import AutoModelForCausalLM

    from rota_tinker._worker.sampling import sample

    vocab = _base(snapshot).config.vocab_size
    engine = BatchedLora(_base(snapshot), "cpu")
    tenants = [{**_tenant(i), "loss_fn": "cross_entropy"} for i in range(6)]
    for t in tenants:
        engine.add(t["name"], t["rank"], seed=int(t["name"][1:]), targets=t["targets"])
        for step in range(2):
            engine.forward_backward([_unit(t, step, vocab)])
            engine.optim_step(t["name"], {"learning_rate": 3e-2})
    requests = [{"tenant": t["name"], "prompt": np.arange(3 + i, 9 + 2 * i) % vocab, "num_samples": 1 + i % 2,
                 "seed": i, "params": {"temperature": 0.0 if i % 2 else 1.0, "max_tokens": 6}}
                for i, t in enumerate(tenants)]
    requests.append({"tenant": None, "prompt": np.arange(5, 12), "num_samples": 2, "seed": 9,
                     "params": {"temperature": 1.0, "max_tokens": 6}})
    together = engine.sample(requests, max_len=128)
    alone = [engine.sample([r], max_len=128)[0] for r in requests]
    base = AutoModelForCausalLM.from_pretrained(snapshot, local_files_only=True, attn_implementation="eager").eval()
    plain = sample(base, [requests[-1]], torch.device("cpu"), 128)[0]  # the bare base, without the engine
    for got, ref in [*zip(together, alone, strict=True), (together[-1], plain)]:
        for (toks, lps, reason, _), (rtoks, rlps, rreason, _) in zip(got["sequences"], ref["sequences"], strict=True):
            assert toks.tolist() == rtoks.tolist() and reason == rreason
            assert np.allclose(lps, rlps, rtol=1e-4, atol=1e-5)
    assert {tuple(s[0].tolist()) for s in together[0]["sequences"]} != \
           {tuple(s[0].tolist()) for s in sample(base, [requests[0]], torch.device("cpu"), 128)[0]["sequences"]}, \
        "the tenant's adapter changed nothing: the comparison shows nothing"


def test_micro_batches_cut_across_tenants_give_the_same_steps(snapshot: Path) -> None:
    """A batch cut into micro-batches of at most 24 tokens (one backward each, a tenant's rows split across them)
    trains as the batch in one piece, within fp32 rounding."""
    vocab = _base(snapshot).config.vocab_size
    tenants = [_tenant(i) for i in range(8)]
    results = {}
    for micro in (24, 1 << 20):
        engine = BatchedLora(_base(snapshot), "cpu")
        for t in tenants:
            engine.add(t["name"], t["rank"], seed=int(t["name"][1:]), targets=t["targets"])
        losses = []
        for step in range(3):
            out = engine.forward_backward([_unit(t, step, vocab) for t in tenants], micro_tokens=micro)
            losses.append([r["metrics"]["loss:sum"] for r in out])
            for t in tenants:
                engine.optim_step(t["name"], {"learning_rate": t["lr"]})
        results[micro] = (losses, {t["name"]: engine.state_dict(t["name"]) for t in tenants})
    (cut, w_cut), (whole, w_whole) = results[24], results[1 << 20]
    assert max(_rel(a, b) for x, y in zip(cut, whole, strict=True) for a, b in zip(x, y, strict=True)) < 1e-4
    assert max(_rel(w_cut[t][k], w_whole[t][k]) for t in w_cut for k in w_cut[t]) < 1e-4


def test_fresh_adapters_are_peft_s_from_the_same_seed(snapshot: Path) -> None:
    """A tenant added with seed s starts from exactly the adapters peft makes from seed s (add_lora, what the
    trainer processes use), and its optimizer orders them as the trainer's does: a checkpoint moves between the
    batched engine and a trainer process either way."""
    from rota_tinker._worker.models import adapters_of, add_lora

    targets = {"attn": True, "mlp": True, "unembed": True}
    engine = BatchedLora(_base(snapshot), "cpu")
    engine.add("t", 8, seed=1234, targets=targets)
    peft_model = add_lora(_base(snapshot), 8, 1234, targets)
    import peft

    theirs = {k: v for k, v in peft.get_peft_model_state_dict(peft_model).items() if ".lora_" in k}
    mine = engine.state_dict("t")
    assert set(mine) == set(theirs)
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] == []
    order = [p.shape for p in adapters_of(peft_model).parameters()]
    assert order == [p.shape for p in engine.adapters["t"].parameters()]
    engine.load("t", {k: v + 1 for k, v in theirs.items()})
    assert all(torch.equal(engine.state_dict("t")[k], theirs[k] + 1) for k in mine)
    with pytest.raises(ValueError, match="missing"):
        engine.load("t", {})


def test_the_grouped_pass_equals_the_reference_path(snapshot: Path) -> None:
    """The grouped segment LoRA (two grouped matmuls forward, four backward, the gradients added straight into
    every tenant's fp32 .grad) trains exactly what each segment's own matmuls through autograd train: losses
    and adapters after 4 steps of 3 tenants, with one forward_only unit and a poisoned neighbour."""
    targets = {"attn": True, "mlp": True, "unembed": True}
    rng = np.random.default_rng(3)
    vocab = 256

    def unit(name: str, rows: int, poison: bool = False, forward_only: bool = False) -> Unit:
        data = []
        for _ in range(rows):
            toks = rng.integers(0, vocab, size=9)
            w = np.full(8, np.nan if poison else 1.0, np.float32)
            data.append((toks[:-1], {"target_tokens": toks[1:], "weights": w}))
        return Unit(name, data, forward_only=forward_only)

    runs = {}
    for grouped in (True, False):
        engine = BatchedLora(_base(snapshot), "cpu")
        engine.grouped = grouped
        for i, name in enumerate(("a", "b", "c")):
            engine.add(name, 8, seed=i, targets=targets)
        calls = {"n": 0}
        original = _GroupedLora.apply

        def counting(*args: Any, _original: Any = original, _calls: dict = calls) -> Any:
            _calls["n"] += 1
            return _original(*args)

        losses = []
        state = rng.bit_generator.state
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_GroupedLora, "apply", counting)
            for _ in range(4):
                out = engine.forward_backward([unit("a", 2), unit("b", 1, poison=True), unit("c", 3, forward_only=True),
                                               unit("a", 1)])
                losses.append([o["metrics"]["loss:sum"] for o in out])
                for name in ("a", "c"):
                    engine.optim_step(name, {"learning_rate": 1e-2})
        rng.bit_generator.state = state  # both runs draw the same data
        assert (calls["n"] > 0) == grouped
        runs[grouped] = (losses, {t: engine.state_dict(t) for t in ("a", "c")})
    (g_loss, g_state), (r_loss, r_state) = runs[True], runs[False]
    worst = max(_rel(x, y) for gl, rl in zip(g_loss, r_loss, strict=True) for x, y in zip(gl, rl, strict=True)
                if not math.isnan(y))
    assert worst < 1e-5, worst
    assert all(math.isnan(gl[1]) for gl in g_loss)  # the poisoned tenant's own loss, nobody else's
    for t in ("a", "c"):
        assert max(_rel(g_state[t][k], r_state[t][k]) for k in g_state[t]) < 1e-5
