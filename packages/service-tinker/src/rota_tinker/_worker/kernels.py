"""Cheaper kernels for the batched LoRA worker's base pass, each equal to what it replaces.

Why: on an H200 the batched pass of a 1.7B base spent about 30% of its device time, and a larger share of its
launches, in the models' own RMSNorm (eight elementwise kernels forward and more backward, 4 norms a layer),
and the per-token logprobs held the logits three times over in fp32. Both are fixed here without changing a
result:

* :func:`exact_rms_norms` points each RMSNorm of the model at torch's fused ``F.rms_norm``, but only a norm
  whose output it equals bit for bit on a probe (the HF norms of Llama/Qwen compute in fp32 and round once, as
  the fused kernel does); any other norm keeps its own forward.
* :func:`token_logprobs` gives ``log_softmax(logits.float())`` at the targets from half-precision logits, a
  few rows at a time in fp32, and its backward recomputes the softmax the same way: the fp32 logits, their
  log-softmax and its gradient are never whole. With :data:`FUSED` on CUDA (without torch's deterministic
  algorithms) the forward's log-sum-exp and the backward's softmax gradient are each one kernel made by
  ``torch.compile``, which reads the half-precision logits and computes in fp32 in registers: on an H100 at 6021981
  (``bench/logprobs_kernel.py``, 8,192 tokens x 151,936) forward and backward took 7.4 ms instead of the chunks'
  33.3 ms (0.22x), with errors against fp64 no larger (logprobs 1.1e-6 vs 1.3e-6, gradient equal). A compile that
  fails falls back to the chunks, once, with a warning. Set :data:`FUSED` False for the chunks everywhere.
"""

from __future__ import annotations

import logging
import types
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

log = logging.getLogger("rota_tinker.worker")

__all__ = ["exact_rms_norms", "fused_logprobs", "token_logprobs"]

CHUNK_ELEMENTS = 1 << 28  # fp32 elements of one chunk of logits (1 GiB): tokens per chunk = this / vocab
FUSED = True  # True: on CUDA the compiled kernels (see the module docs); False: the eager chunks everywhere


def _fused_norm(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), self.weight, self.variance_epsilon)


def exact_rms_norms(model: nn.Module, probe_rows: int = 64) -> int:
    """Give every RMSNorm of ``model`` (a module with a 1-D ``weight`` and ``variance_epsilon``, as HF's are) the
    fused kernel where the fused output equals its own on a random probe in its dtype; returns how many."""
    if not hasattr(F, "rms_norm"):
        return 0
    done, verdicts = 0, {}
    gen = torch.Generator().manual_seed(0)
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (not type(module).__name__.endswith("RMSNorm") or not isinstance(getattr(module, "variance_epsilon", None),
                                                                            float)
                or not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.is_meta):
            continue
        key = (type(module), weight.shape[0], weight.dtype, weight.device)
        if key not in verdicts:
            probe = (torch.randn(probe_rows, weight.shape[0], generator=gen) * 3).to(weight.device, weight.dtype)
            with torch.no_grad():
                verdicts[key] = torch.equal(module(probe), _fused_norm(module, probe))
        if verdicts[key]:
            module.forward = types.MethodType(_fused_norm, module)
            done += 1
    return done


def _lse_rows(logits: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows]``: each row's log-sum-exp of ``logits`` ``[rows, vocab]``, computed in fp32."""
    return torch.logsumexp(logits.float(), -1)


def _grad_rows(logits: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``d (grad * log p(target)) / d logits`` for rows ``[rows, vocab]``: ``grad * (onehot - softmax)`` in fp32,
    rounded once to the logits' dtype."""
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets.unsqueeze(-1)
    p = torch.exp(logits.float() - lse.unsqueeze(-1))
    return (grad.unsqueeze(-1) * (hit.float() - p)).to(logits.dtype)


class _Fused:
    """The compiled :func:`_lse_rows` and :func:`_grad_rows`, made on first use; ``broken`` after a failure."""

    lse: Any = None
    grad: Any = None
    broken = False

    @classmethod
    def usable(cls, logits: torch.Tensor) -> bool:
        return (FUSED and not cls.broken and logits.is_cuda and logits.dim() == 2
                and not torch.are_deterministic_algorithms_enabled())

    @classmethod
    def run(cls, which: str, *args: torch.Tensor) -> torch.Tensor | None:
        """The compiled kernel's result, or None if it cannot compile here (then never tried again)."""
        try:
            if cls.lse is None:
                cls.lse = torch.compile(_lse_rows, dynamic=True, fullgraph=True)
                cls.grad = torch.compile(_grad_rows, dynamic=True, fullgraph=True)
            return getattr(cls, which)(*args)
        except torch.OutOfMemoryError:
            raise
        except Exception as exc:  # no compiler or Triton here: the eager chunks give the same values
            cls.broken = True
            log.warning("token_logprobs: torch.compile failed (%s: %s); using the eager fp32 chunks",
                        type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            return None


def fused_logprobs() -> str:
    """Which path :func:`token_logprobs` took in this process: ``"compiled"`` (the fused kernels ran),
    ``"failed"`` (their compile failed: eager chunks since) or ``"unused"`` (not on CUDA, or not asked yet)."""
    return "failed" if _Fused.broken else "compiled" if _Fused.lse is not None else "unused"


class _TokenLogprobs(torch.autograd.Function):
    """``log_softmax(logits.float(), -1)`` gathered at ``targets``, fused or by chunks of rows (see the module docs)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = _Fused.run("lse", logits) if _Fused.usable(logits) else None
        if lse is None:
            rows = _rows_per_chunk(logits)
            lse = torch.cat([_lse_rows(c) for c in logits.split(rows)])
        picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1).float()
        ctx.save_for_backward(logits, targets, lse)
        return picked - lse

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        if _Fused.usable(logits):
            out = _Fused.run("grad", logits, lse, grad.float(), targets)
            if out is not None:
                return out, None
        out = torch.empty_like(logits)
        rows = _rows_per_chunk(logits)
        for lo in range(0, logits.shape[0], rows):
            hi = min(lo + rows, logits.shape[0])
            g = grad[lo:hi].unsqueeze(-1)
            chunk = torch.exp(logits[lo:hi].float() - lse[lo:hi].unsqueeze(-1)).mul_(-g)  # d lp / d logit: -p ...
            chunk.scatter_add_(-1, targets[lo:hi].unsqueeze(-1), g)  # ... plus one at the target
            out[lo:hi] = chunk
        return out, None


def _rows_per_chunk(logits: torch.Tensor) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, logits[0].numel()))


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """fp32 ``[rows, length]``: log p(targets) under ``logits`` ``[rows, length, vocab]`` (any float dtype)."""
    flat = _TokenLogprobs.apply(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    return flat.view(targets.shape)
