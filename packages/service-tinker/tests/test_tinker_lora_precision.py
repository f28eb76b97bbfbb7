"""LoRA on a half-precision base computes in the base's dtype, with fp32 adapters (rota_tinker._worker.models).

peft would cast every LoRA input to fp32; the service runs those matmuls in the base's bf16
instead (autocast), as mixed-precision training does. What must hold: the adapters, their
gradients and Adam state stay fp32; no LoRA layer sees an fp32 input; the logprobs agree with
peft's fp32 path to bf16's precision; an fp32 base is untouched; and it is deterministic.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rota_tinker import find_models
from rota_tinker._worker.models import add_lora, batch_logprobs, build_base, lora_compute_dtype, lora_in_base_precision
from rota_tinker.testing import hf_snapshot

TARGETS = {"attn": True, "mlp": True, "unembed": True}


def lora_model(folder: Path, dtype: str) -> torch.nn.Module:
    hf_snapshot(folder / "m", dtype=dtype, hidden=64, layers=2)
    (spec,) = find_models([str(folder)]).values()
    return add_lora(build_base(spec, torch.device("cpu")), 4, 7, TARGETS)


def lora_inputs(model: torch.nn.Module, run: callable) -> set[torch.dtype]:
    """The dtypes the LoRA A linears were called with while ``run()`` ran."""
    seen: set[torch.dtype] = set()
    hooks = [m.register_forward_pre_hook(lambda _m, args: seen.add(args[0].dtype))
             for name, m in model.named_modules() if name.endswith("lora_A.default")]
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.fixture
def tokens() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], ids[:, 1:]


def test_lora_on_a_bf16_base_runs_in_bf16_with_fp32_adapters(tmp_path: Path, tokens: tuple) -> None:
    model = lora_model(tmp_path, "bfloat16")
    for name, p in model.named_parameters():  # LoRA B starts at zero: give the adapters something to do
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05, generator=torch.Generator().manual_seed(1))
    x, y = tokens
    assert lora_inputs(model, lambda: batch_logprobs(model, x, y)) == {torch.bfloat16}

    def peft_fp32_path() -> torch.Tensor:  # what peft does alone: LoRA inputs cast to the adapters' fp32
        out = model(x, use_cache=False).logits.float()
        return torch.gather(torch.log_softmax(out, -1), 2, y.unsqueeze(2)).squeeze(2)
    assert lora_inputs(model, peft_fp32_path) == {torch.float32}  # the control: without the context, fp32

    lp = batch_logprobs(model, x, y)
    torch.testing.assert_close(lp, peft_fp32_path(), atol=0.1, rtol=0.02)  # bf16's precision, not more
    assert torch.equal(lp, batch_logprobs(model, x, y))  # deterministic

    (-lp.sum()).backward()
    adapters = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for _, p in adapters)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for _, p in adapters)
    assert any(p.grad.abs().sum() > 0 for n, p in adapters if "lora_A" in n)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)  # the base is never trained


def test_an_fp32_base_is_left_as_it_is(tmp_path: Path, tokens: tuple) -> None:
    model = lora_model(tmp_path, "float32")
    x, y = tokens
    assert lora_inputs(model, lambda: batch_logprobs(model, x, y)) == {torch.float32}
    assert lora_compute_dtype(model) is None
    with lora_in_base_precision(model, lora_compute_dtype(model)):
        assert not torch.is_autocast_enabled("cpu")
