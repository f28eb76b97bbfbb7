"""Tiny deterministic training used by the adapter's tests (and its 2-rank worker)."""

from __future__ import annotations

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    """A small MLP with parameters *and* buffers (BatchNorm running stats, step counter)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def batch(step: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)


def train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int = 0) -> torch.Tensor:
    x, y = batch(step, rank)
    opt.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach().clone()


def snapshot(model: nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, torch.Tensor]:
    """Every parameter, buffer and optimizer-state tensor, cloned (local shards for DTensors)."""
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = _local(t).detach().clone()
    if opt is not None:
        for i, (_, state) in enumerate(opt.state.items()):
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    out[f"opt.{i}.{k}"] = _local(v).clone()
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    return getattr(t, "_local_tensor", t)
