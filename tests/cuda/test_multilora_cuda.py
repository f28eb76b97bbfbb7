"""rota_tinker's batched multi-LoRA on a GPU: equal ranks take ``torch.nn.functional.grouped_mm`` (two grouped
matmuls per adapted linear for every tenant of the batch), and 8 tenants batched equal each alone within bf16
rounding. Written in the session that added the engine (its CPU twin is
packages/service-tinker/tests/test_tinker_multilora.py); the tier runs it on the next GPU session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

TOLERANCE = 2e-2  # relative: bf16 keeps 8 bits of mantissa, and 4 steps of Adam amplify a rounding step


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rota_tinker.testing import hf_snapshot

    return hf_snapshot(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=5, hidden=256, layers=2, dtype="bfloat16",
                       intermediate_size=512, head_dim=64)


def _engine(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    from rota_tinker._worker.multilora import BatchedLora

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, local_files_only=True,
                                                 attn_implementation="eager").to("cuda:0").eval()
    return BatchedLora(model, "cuda:0")


def test_equal_ranks_run_grouped_and_equal_each_alone(snapshot: Path, record: Any,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    from rota_tinker._worker.multilora import F, Unit

    calls = {"grouped_mm": 0}
    real = F.grouped_mm

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["grouped_mm"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "grouped_mm", counted)
    targets = {"attn": True, "mlp": True}
    tenants = [f"t{i}" for i in range(8)]

    def units(step: int) -> list[Any]:
        out = []
        for i, t in enumerate(tenants):
            rng = np.random.default_rng([i, step])
            toks = rng.integers(0, 200, size=33)
            out.append(Unit(t, [(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(32, np.float32)})]))
        return out

    together = _engine(snapshot)
    alone = {t: _engine(snapshot) for t in tenants}
    for i, t in enumerate(tenants):
        together.add(t, 16, seed=i, targets=targets)
        alone[t].add(t, 16, seed=i, targets=targets)
    worst = 0.0
    for step in range(4):
        batch = units(step)
        got = together.forward_backward(batch)
        for unit, mine in zip(batch, got, strict=True):
            ref = alone[unit.tenant].forward_backward([unit])[0]["metrics"]["loss:sum"]
            worst = max(worst, abs(mine["metrics"]["loss:sum"] - ref) / abs(ref))
        for t in tenants:
            together.optim_step(t, {"learning_rate": 1e-3})
            alone[t].optim_step(t, {"learning_rate": 1e-3})
    record(worst_relative_loss=worst, grouped_mm_calls=calls["grouped_mm"])
    assert calls["grouped_mm"] > 0, "equal ranks on CUDA bf16 did not take grouped_mm"
    assert worst <= TOLERANCE, worst


def test_the_grouped_pass_equals_the_reference_path_on_cuda(snapshot: Path, record: Any) -> None:
    """The grouped segment LoRA (rota_tinker._worker.multilora._GroupedLora: its own backward, gradients added straight
    into the fp32 .grad) trains what each segment's own matmuls through autograd train, in bf16 on the GPU."""
    import numpy as np

    from rota_tinker._worker.multilora import Unit

    targets = {"attn": True, "mlp": True, "unembed": True}
    runs = {}
    for grouped in (True, False):
        engine = _engine(snapshot)
        engine.grouped = grouped
        for i in range(4):
            engine.add(f"t{i}", 16, seed=i, targets=targets)
        losses = []
        for step in range(4):
            batch = []
            for i in range(4):
                rng = np.random.default_rng([i, step, 7])
                data = []
                for _ in range(1 + i % 2):
                    toks = rng.integers(0, 200, size=33)
                    data.append((toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(32, np.float32)}))
                batch.append(Unit(f"t{i}", data))
            losses += [r["metrics"]["loss:sum"] for r in engine.forward_backward(batch)]
            for i in range(4):
                engine.optim_step(f"t{i}", {"learning_rate": 1e-3})
        runs[grouped] = (losses, [engine.state_dict(f"t{i}") for i in range(4)])
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(runs[True][0], runs[False][0], strict=True))
    worst_weight = max(float((g[k] - r[k]).abs().max() / r[k].abs().max().clamp_min(1e-12))
                       for g, r in zip(runs[True][1], runs[False][1], strict=True) for k in r)
    record(worst_relative_loss=worst_loss, worst_relative_weight=worst_weight)
    assert worst_loss <= TOLERANCE and worst_weight <= 10 * TOLERANCE, (worst_loss, worst_weight)


def test_the_batch_kernels_and_fused_adam_on_cuda(snapshot: Path, record: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the GPU: the model's RMSNorms take torch's fused kernel (only where it equals theirs bit for bit),
    token_logprobs (its compiled kernels) equals log_softmax from bf16 logits, and a tenant's fused AdamW state goes
    out as a trainer's ``optimizer.pt`` (step counts on the host) and back: a copy loaded from it takes the same
    next step, bit for bit."""
    import io

    import numpy as np
    from torch.nn import functional as F

    from rota_tinker._worker import kernels
    from rota_tinker._worker.multilora import Unit

    monkeypatch.setattr(kernels, "FUSED", True)  # token_logprobs' compiled kernels (the default: kept on here)
    engine = _engine(snapshot)  # BatchedLora.__init__ made the norms exact-fused
    fused = sum("forward" in vars(m) for m in engine.model.modules() if type(m).__name__.endswith("RMSNorm"))
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    logits = (torch.randn(4, 64, 1000, device="cuda:0", generator=gen) * 4).bfloat16()
    targets = torch.randint(0, 1000, (4, 64), device="cuda:0", generator=gen)
    mine, theirs = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    got = kernels.token_logprobs(mine, targets)
    want = F.log_softmax(theirs.float(), -1).gather(2, targets.unsqueeze(2)).squeeze(2)
    got.sum().backward()
    want.sum().backward()
    lp_diff = float((got - want).abs().max())
    grad_diff = float((mine.grad.float() - theirs.grad.float()).abs().max())
    for name in ("t", "copy"):
        engine.add(name, 16, seed=0, targets={"attn": True, "mlp": True, "unembed": True})

    def unit(name: str, seed: int) -> Any:
        toks = np.random.default_rng(seed).integers(0, 200, size=65)
        return Unit(name, [(toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(64, np.float32)})])

    for step in range(2):
        engine.forward_backward([unit("t", step)])
        engine.optim_step("t", {"learning_rate": 1e-3})
    buffer = io.BytesIO()
    torch.save(engine.optimizer_state("t"), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="cpu", weights_only=True)
    engine.load("copy", engine.state_dict("t"))
    engine.load_optimizer_state("copy", state)
    for name in ("t", "copy"):
        engine.forward_backward([unit(name, 9)])
        engine.optim_step(name, {"learning_rate": 1e-3})
    t, c = engine.state_dict("t"), engine.state_dict("copy")
    unequal = [k for k in t if not torch.equal(t[k], c[k])]
    record(fused_rms_norms=fused, token_logprobs_max_abs_diff=lp_diff, token_logprobs_grad_max_abs_diff=grad_diff,
           token_logprobs_path=kernels.fused_logprobs(),
           adam_fused=bool(engine.adapters["t"].optimizer.param_groups[0]["fused"]),
           adam_round_trip_unequal=len(unequal))
    assert fused > 0, "no RMSNorm of the Qwen3 model equals torch's fused kernel on this GPU"
    assert lp_diff <= 1e-4 and grad_diff <= 1e-2, (lp_diff, grad_diff)
    assert kernels.fused_logprobs() == "compiled", "token_logprobs' compiled kernels did not run on this GPU"
    assert engine.adapters["t"].optimizer.param_groups[0]["fused"] is True
    assert all(s["step"].device.type == "cpu" for s in state["state"].values())
    assert unequal == []
