"""The demo's small but real torch workloads: an RL policy trained by REINFORCE from
rollouts its own sampler generates, and an SFT model with an eval sampler.

Every step is a pure function of (seed, step, weights), so a run is bit-identical
whether its worker had a dedicated device or took turns through rota. Imports torch,
so the ``rota demo`` command loads it only when it runs (``rota --help`` stays light).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["ModelSize", "Policy", "build", "eval_loss", "generate", "reinforce_step", "reward", "sft_accumulate",
           "sft_batch", "sft_step"]


@dataclass(frozen=True)
class ModelSize:
    """Shape of every demo model; ``state_bytes`` is what one trainer parks."""

    vocab: int = 64
    hidden: int = 512
    layers: int = 3
    seq: int = 16
    batch: int = 64

    @property
    def params(self) -> int:
        return 2 * self.vocab * self.hidden + self.layers * (self.hidden * self.hidden + self.hidden) + self.vocab

    @property
    def trainer_state_bytes(self) -> int:
        """fp32 weights + grads + two AdamW moments."""
        return self.params * 4 * 4

    @property
    def weight_bytes(self) -> int:
        """fp32 weights: what a sampler holds and parks."""
        return self.params * 4

    @property
    def push_bytes(self) -> int:
        """Size of the shared buffer that carries the weights to the sampler (state-dict order, aligned slices)."""
        from rota_demo.push import push_bytes

        numels = [self.vocab * self.hidden, *[self.hidden * self.hidden, self.hidden] * self.layers,
                  self.vocab * self.hidden, self.vocab]
        return push_bytes([(n, 4) for n in numels])

    @classmethod
    def for_state_bytes(cls, target: int, *, layers: int = 8, vocab: int = 1024, batch: int = 64,
                        seq: int = 16) -> ModelSize:
        """Size whose trainer state (weights, grads, AdamW) is about ``target`` bytes."""
        params = target / 16
        hidden = int(math.sqrt(max(params / layers, 1)))
        return cls(vocab=vocab, hidden=max(64, hidden // 64 * 64), layers=layers, batch=batch, seq=seq)


class Policy(nn.Module):
    """Next-token model: embedding, residual MLP blocks, output head."""

    def __init__(self, size: ModelSize) -> None:
        super().__init__()
        self.embed = nn.Embedding(size.vocab, size.hidden)
        self.blocks = nn.ModuleList(nn.Linear(size.hidden, size.hidden) for _ in range(size.layers))
        self.head = nn.Linear(size.hidden, size.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = h + torch.tanh(block(h))
        return self.head(h)


def build(size: ModelSize, seed: int, device: str, *, optimizer: bool) -> tuple[Policy, torch.optim.Optimizer | None]:
    """The model (and AdamW) every mode starts from for this seed."""
    torch.manual_seed(seed)
    if device != "cpu":
        torch.cuda.manual_seed(seed)
    with torch.device(device):  # initialise on the device: a 20 GB model built on the host takes minutes
        model = Policy(size)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01) if optimizer else None
    return model, opt


def _gen(seed: int, step: int, device: str) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 100_003 + step)
    return g


@torch.no_grad()
def generate(model: Policy, size: ModelSize, seed: int, step: int, device: str) -> torch.Tensor:
    """Sample ``batch`` sequences token by token with the current policy."""
    g = _gen(seed, step, device)
    tokens = torch.zeros(size.batch, 1, dtype=torch.long, device=device)
    for _ in range(size.seq - 1):
        logits = model(tokens[:, -1:])[:, -1, :].float()
        probs = torch.softmax(logits, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=g)
        tokens = torch.cat([tokens, nxt], dim=1)
    return tokens


def reward(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """The 'judge' (runs on the host): rewards counting up by 3 modulo the vocabulary."""
    good = (tokens[:, 1:] == (tokens[:, :-1] + 3) % vocab).float()
    return good.mean(dim=1)


def reinforce_step(model: Policy, opt: torch.optim.Optimizer, tokens: torch.Tensor, rewards: torch.Tensor) -> float:
    """One policy-gradient update; returns the loss."""
    logits = model(tokens[:, :-1])
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens[:, 1:].unsqueeze(-1)).squeeze(-1)
    advantage = rewards - rewards.mean()
    loss = -(advantage.unsqueeze(1) * logp).mean()
    opt.zero_grad(set_to_none=False)
    loss.backward()
    opt.step()
    return float(loss.item())


def sft_batch(size: ModelSize, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A synthetic supervised batch (made on the host, like a data loader's)."""
    g = _gen(seed, step, "cpu")
    x = torch.randint(0, size.vocab, (size.batch, size.seq), generator=g)
    return x, (x * 3 + 1) % size.vocab


def sft_accumulate(model: Policy, x: torch.Tensor, y: torch.Tensor, parts: int) -> float:
    """Forward and backward one of ``parts`` equal microbatches into the grads; returns its share of the loss.

    An SFT step is ``parts`` of these (grads zeroed before the first) and one optimizer
    step: the job can give the device back between microbatches, so a waiting RL job
    waits at most one microbatch. Every mode runs the same sequence, so the numbers do
    not depend on whether the turns were shared.
    """
    loss = nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) / parts
    loss.backward()
    return float(loss.item())


def sft_step(model: Policy, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, parts: int = 1, *,
             device: str | None = None, turn: Callable[[bool], AbstractContextManager] | None = None) -> float:
    """A whole SFT step: ``parts`` microbatches (each moved to ``device``, default the model's device at that
    turn: a turn may run on another device than the last), then the update.

    ``turn(last)`` wraps each microbatch (the worker's device phase: it gives the device back
    between microbatches; the last one also updates). Without it, nothing is given back.
    """
    loss = 0.0
    for i, (xi, yi) in enumerate(zip(x.chunk(parts), y.chunk(parts), strict=True)):
        last = i == parts - 1
        with turn(last) if turn is not None else contextlib.nullcontext():
            if i == 0:
                opt.zero_grad(set_to_none=False)
            to = device or next(model.parameters()).device
            loss += sft_accumulate(model, xi.to(to), yi.to(to), parts)
            if last:
                opt.step()
    return loss


@torch.no_grad()
def eval_loss(model: Policy, x: torch.Tensor, y: torch.Tensor) -> float:
    return float(nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()).item())
