"""The batched LoRA worker's cheaper kernels (rota_tinker._worker.kernels) and what its micro-batch does with them.

* ``token_logprobs`` (logits kept once, fp32 by chunks) gives log_softmax's values and gradients;
* the gradient its compiled CUDA kernels compute is log_softmax's; a compile that fails falls back, once;
* ``exact_rms_norms`` swaps in torch's fused RMSNorm only where it equals the model's own, here a real Qwen3
  loaded with ``from_pretrained``, and leaves a norm of another formula alone;
* a forward-only row whose inputs are NaN, in the same pass as its tenant's training rows, adds nothing to that
  tenant's gradients;
* a tenant's AdamW state leaves the engine as a trainer's ``optimizer.pt`` holds it and comes back equal.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from rota_tinker._worker import kernels
from rota_tinker._worker.multilora import BatchedLora, Unit
from rota_tinker.testing import hf_snapshot


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return hf_snapshot(tmp_path_factory.mktemp("qwen3"), "qwen3", seed=3, hidden=32, layers=2)


def _model(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, attn_implementation="eager").eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_logprobs_equal_log_softmax_in_value_and_gradient(dtype: torch.dtype,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "CHUNK_ELEMENTS", 2 * 7 * 50)  # chunks of 14 tokens (2 rows): seams are crossed
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(5, 7, 50, generator=gen) * 4).to(dtype)
    targets = torch.randint(0, 50, (5, 7), generator=gen)
    upstream = torch.randn(5, 7, generator=gen)
    mine = logits.clone().requires_grad_(True)
    theirs = logits.clone().requires_grad_(True)
    got = kernels.token_logprobs(mine, targets)
    want = F.log_softmax(theirs.float(), -1).gather(2, targets.unsqueeze(2)).squeeze(2)
    assert got.dtype == torch.float32
    assert torch.allclose(got, want, rtol=0, atol=1e-5), float((got - want).abs().max())
    (got * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert mine.grad.dtype == dtype
    scale = float(theirs.grad.float().abs().max())
    worst = float((mine.grad.float() - theirs.grad.float()).abs().max())
    assert worst <= (1e-6 if dtype == torch.float32 else 1e-2) * scale, (worst, scale)


def test_the_fused_gradient_formula_equals_log_softmax_and_a_failed_compile_falls_back(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """What the compiled kernels compute (kernels.FUSED, CUDA only; run uncompiled here): the gradient
    ``grad * (onehot - softmax)`` rounded once equals log_softmax's autograd within bf16 rounding; a compile that
    fails is reported once and the eager chunks take over."""
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(9, 40, generator=gen) * 4).bfloat16()
    targets = torch.randint(0, 40, (9,), generator=gen)
    upstream = torch.randn(9, generator=gen)
    theirs = logits.float().requires_grad_(True)
    (F.log_softmax(theirs, -1).gather(1, targets[:, None]).squeeze(1) * upstream).sum().backward()
    got = kernels._grad_rows(logits, kernels._lse_rows(logits), upstream, targets)
    assert got.dtype == torch.bfloat16
    assert torch.allclose(got.float(), theirs.grad, rtol=1e-2, atol=1e-3)

    def no_compiler(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("no C compiler here")

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(kernels._Fused, "lse", None)
    monkeypatch.setattr(kernels._Fused, "broken", False)
    with caplog.at_level("WARNING", logger="rota_tinker.worker"):
        assert kernels._Fused.run("lse", logits) is None
    assert kernels.fused_logprobs() == "failed"
    assert "torch.compile failed (RuntimeError: no C compiler here)" in caplog.text
    monkeypatch.setattr(kernels, "FUSED", True)
    assert not kernels._Fused.usable(logits)  # never tried again (and CPU logits never take it)


def test_exact_rms_norms_take_the_fused_kernel_only_where_it_is_equal(snapshot: Path) -> None:
    model = _model(snapshot)
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before = model(tokens, use_cache=False).logits
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert kernels.exact_rms_norms(model) == len(norms) > 0
    assert all("forward" in vars(m) for m in norms)  # the instance's own forward now
    with torch.no_grad():
        after = model(tokens, use_cache=False).logits
    assert torch.equal(before, after)

    class OffsetRMSNorm(nn.Module):  # Gemma's formula: x * (1 + w); the fused kernel computes x * w
        def __init__(self) -> None:
            super().__init__()
            self.weight, self.variance_epsilon = nn.Parameter(torch.zeros(8)), 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * (1 + self.weight)

    other = nn.Sequential(OffsetRMSNorm())
    assert kernels.exact_rms_norms(other) == 0
    assert "forward" not in vars(other[0])


def _rows(seed: int, n: int, weights: float = 1.0) -> list[tuple[Any, dict[str, Any]]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, 100, size=9)
        out.append((toks[:-1], {"target_tokens": toks[1:], "weights": np.full(8, weights, np.float32)}))
    return out


def test_a_forward_only_row_of_nan_adds_nothing_to_its_tenants_gradients(snapshot: Path) -> None:
    grads = {}
    for with_forward in (False, True):
        engine = BatchedLora(_model(snapshot), "cpu")
        engine.add("t", 4, seed=0, targets={"attn": True, "mlp": True})
        engine.add("u", 4, seed=1, targets={"attn": True, "mlp": True})
        units = [Unit("t", _rows(0, 2)), Unit("u", _rows(1, 1))]
        if with_forward:  # in the same micro-batch as t's training rows
            units.insert(1, Unit("t", _rows(2, 2, weights=float("nan")), forward_only=True))
        results = engine.forward_backward(units)
        if with_forward:
            assert np.isnan(results[1]["metrics"]["loss:sum"])
        grads[with_forward] = [p.grad.clone() for a in engine.adapters.values() for p in a.parameters()]
    assert all(torch.isfinite(g).all() for g in grads[True])
    assert all(torch.equal(a, b) for a, b in zip(grads[False], grads[True], strict=True))


def test_adam_state_leaves_as_a_trainers_and_comes_back_equal(snapshot: Path) -> None:
    engine = BatchedLora(_model(snapshot), "cpu")
    for name in ("t", "copy"):
        engine.add(name, 4, seed=0, targets={"mlp": True})
    for _ in range(2):
        engine.forward_backward([Unit("t", _rows(0, 1))])
        engine.optim_step("t", {"learning_rate": 1e-2})
    buffer = io.BytesIO()  # through a file's bytes, as optimizer.pt goes (no tensor shared with the live state)
    torch.save(engine.optimizer_state("t"), buffer)
    buffer.seek(0)
    state = torch.load(buffer, map_location="cpu", weights_only=True)
    assert all(group["fused"] is None for group in state["param_groups"])
    assert all(s["step"].device.type == "cpu" for s in state["state"].values())
    trainer = torch.optim.AdamW([nn.Parameter(p.detach().clone()) for p in engine.adapters["t"].parameters()])
    trainer.load_state_dict(state)  # what a trainer process does with optimizer.pt
    engine.load("copy", engine.state_dict("t"))
    engine.load_optimizer_state("copy", state)
    for name in ("t", "copy"):
        engine.forward_backward([Unit(name, _rows(5, 1))])
        engine.optim_step(name, {"learning_rate": 1e-2})
    t, c = engine.state_dict("t"), engine.state_dict("copy")
    assert all(torch.equal(t[k], c[k]) for k in t)
    engine.load_optimizer_state("copy", None)
    assert not engine.adapters["copy"].optimizer.state
