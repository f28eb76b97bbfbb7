"""A third torch adapter, defined here as a user would write it: one Tracked subclass is enough.

The toy framework keeps state where the defaults would not look: a recurrent memory as
a plain tensor attribute (neither parameter nor buffer) and SGD momentum. The subclass
names those tensors through the public hooks; parking every step through the real
orchestrator must then free them and give back a bit-identical trajectory.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from rota_torch import Tracked, align

STEPS = 12


class Recurrent(nn.Module):
    """A layer whose memory carries over between steps, kept as a plain attribute."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.memory = torch.zeros(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.tanh(self.proj(x) + self.memory)
        self.memory.copy_(out.detach().mean(0))  # in place: the parked storage is the live one
        return out


class RecurrentTracked(Tracked):
    """The whole adapter: which tensors make up a Recurrent job, per tag."""

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return [*self.model.named_parameters(), ("memory", self.model.memory)]

    def grads(self) -> Iterable[tuple[str, torch.Tensor]]:
        return [(n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None]

    def optimizer_state(self) -> Iterable[tuple[str, torch.Tensor]]:
        return [(f"momentum.{i}", s["momentum_buffer"]) for i, s in enumerate(self.optimizer.state.values())
                if isinstance(s.get("momentum_buffer"), torch.Tensor)]

    def pool_estimate(self) -> int:
        tensors = [*self.model.parameters(), self.model.memory]
        return sum(align(t.untyped_storage().nbytes()) for t in tensors) * 3  # weights, grads, momentum


def _setup() -> tuple[Recurrent, torch.optim.Optimizer]:
    model = Recurrent()
    return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _step(model: Recurrent, opt: torch.optim.Optimizer, i: int) -> torch.Tensor:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    return loss.detach().clone()


def _state(model: Recurrent, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    momentum = [s["momentum_buffer"] for s in opt.state.values()]
    return [t.detach().clone() for t in [*model.parameters(), model.memory, *momentum]]


def test_a_third_adapter_parks_and_restores_bit_identically(torch_connect):
    model, opt = _setup()
    want_losses = [_step(model, opt, i) for i in range(STEPS)]
    want_state = _state(model, opt)

    gpu = torch_connect("recurrent")
    model, opt = _setup()
    tracked = RecurrentTracked(gpu, model, opt, verify="full")
    losses = []
    for i in range(STEPS):
        with gpu.turn():
            losses.append(_step(model, opt, i))
        result = gpu.park()
        assert tracked.parked and result.by_tag["weights"] > 0 and result.by_tag["optimizer"] > 0
        assert "untracked:memory" not in result.residue  # the override parked what the defaults would leave
        held = [*model.parameters(), model.memory, *(s["momentum_buffer"] for s in opt.state.values())]
        assert all(t.untyped_storage().nbytes() == 0 for t in held)
    with gpu.turn():
        got_state = _state(model, opt)
    assert len(gpu.stats.parks) == STEPS and len(gpu.stats.restores) == STEPS
    assert all(torch.equal(g, w) for g, w in zip(losses, want_losses, strict=True))
    assert len(got_state) == len(want_state)
    assert all(torch.equal(g, w) for g, w in zip(got_state, want_state, strict=True))


def test_the_defaults_alone_would_leave_the_memory_behind(torch_connect):
    """The check above can fail: a bare Tracked does not know the memory and reports it as residue."""
    model, opt = _setup()
    tracked = Tracked(torch_connect("bare"), model, opt)
    with tracked.gpu.turn():
        _step(model, opt, 0)
    result = tracked.gpu.park()
    assert result.residue.get("untracked:memory") == model.memory.untyped_storage().nbytes() > 0
