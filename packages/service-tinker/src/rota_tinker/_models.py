"""The models behind the service: a small causal transformer, LoRA adapters, losses, sampling.

Imported only by worker processes (:mod:`rota_tinker._worker`); the HTTP process builds no
model (it still has torch loaded when torch is installed: the tinker SDK's types import it).
Weights are random-init from the base model's seed (no hub downloads) or loaded from a
local file, so the same base model name gives the same weights in every process, and a
LoRA tenant's sampler can rebuild the base and load only the adapter.

Everything here is deterministic on CPU (fixed seeds, one thread): a loop run alone and
the same loop run time-sliced beside another tenant give bit-identical losses.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from rota_tinker._config import BaseModelSpec

LORA_TARGETS = {"attn": ("q", "k", "v", "o"), "mlp": ("up", "down"), "unembed": ("unembed",)}


class LoraLinear(nn.Module):
    """``base(x) + (x @ A.T @ B.T) * alpha / rank``; B starts at zero so the adapter starts as a no-op."""

    def __init__(self, base: nn.Linear, rank: int, generator: torch.Generator) -> None:
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = 32.0 / rank
        a = torch.empty(rank, base.in_features)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        self.lora_a = nn.Parameter(a.to(base.weight.device))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t() @ self.lora_b.t()) * self.scale


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """A small causal LM: token + position embeddings, ``layers`` blocks, an unembedding."""

    def __init__(self, spec: BaseModelSpec) -> None:
        super().__init__()
        self.spec = spec
        self.tok = nn.Embedding(spec.vocab, spec.dim)
        self.pos = nn.Embedding(spec.max_len, spec.dim)
        self.blocks = nn.ModuleList(Block(spec.dim, spec.heads) for _ in range(spec.layers))
        self.ln = nn.LayerNorm(spec.dim)
        self.unembed = nn.Linear(spec.dim, spec.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[-1], device=tokens.device)
        x = self.tok(tokens) + self.pos(pos)
        for blk in self.blocks:
            x = blk(x)
        return self.unembed(self.ln(x))


def build_base(spec: BaseModelSpec, device: torch.device) -> TinyLM:
    """The base model: its weights from ``spec.path`` if given, else a function of ``spec.seed`` only."""
    if spec.path is not None:
        with torch.device("meta"):
            model = TinyLM(spec)
        model.load_state_dict(_checked_state(spec, model), assign=True)
        return model.to(device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(spec.seed)
        model = TinyLM(spec)
    return model.to(device)


def _checked_state(spec: BaseModelSpec, model: TinyLM) -> dict[str, torch.Tensor]:
    """``spec.path``'s state dict, checked key by key against the model of ``spec``'s shape (errors name both)."""
    try:
        state = torch.load(spec.path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"base model {spec.name!r}: cannot load {spec.path!r} ({type(e).__name__}: {e}); "
                         "it must be a torch.save'd state_dict (rota_tinker.save_base writes one)") from e
    if not isinstance(state, dict):
        raise ValueError(f"base model {spec.name!r}: {spec.path!r} holds a {type(state).__name__}, not a state_dict")
    want = model.state_dict()
    missing, extra = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or extra:
        raise ValueError(f"base model {spec.name!r}: {spec.path!r} does not match vocab={spec.vocab} dim={spec.dim} "
                         f"layers={spec.layers} heads={spec.heads} max_len={spec.max_len}: missing {missing[:4]}, "
                         f"unexpected {extra[:4]}")
    for key, ref in want.items():
        got = state[key]
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(ref.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ValueError(f"base model {spec.name!r}: {key} in {spec.path!r} has shape {shape}, the spec needs "
                             f"{tuple(ref.shape)}")
    return {k: state[k].to(torch.float32) for k in want}


def save_base(spec: BaseModelSpec, path: str) -> None:
    """Write the base model of ``spec`` (random-init from its seed, or loaded) as a state dict at ``path``.

    Gives a file that a ``BaseModelSpec(path=...)`` of the same shape loads.
    """
    torch.save(build_base(spec, torch.device("cpu")).state_dict(), path)


def add_lora(model: TinyLM, rank: int, seed: int, targets: dict[str, bool]) -> nn.ModuleDict:
    """Wrap the chosen linears of ``model`` in :class:`LoraLinear`; returns the adapters (what is trained/parked)."""
    gen = torch.Generator().manual_seed(seed)
    adapters: dict[str, LoraLinear] = {}
    owners: list[tuple[str, nn.Module]] = [(f"blocks.{i}", blk) for i, blk in enumerate(model.blocks)]
    for group, names in LORA_TARGETS.items():
        if not targets.get(group):
            continue
        for name in names:
            if group == "unembed":
                lora = LoraLinear(model.unembed, rank, gen)
                model.unembed = lora  # type: ignore[assignment]
                adapters["unembed"] = lora
                continue
            for prefix, blk in owners:
                lora = LoraLinear(getattr(blk, name), rank, gen)
                setattr(blk, name, lora)
                adapters[f"{prefix}.{name}".replace(".", "_")] = lora
    for p in model.parameters():
        p.requires_grad_(False)
    trainable = nn.ModuleDict()
    for key, lora in adapters.items():
        lora.lora_a.requires_grad_(True)
        lora.lora_b.requires_grad_(True)
        holder = nn.Module()
        holder.lora_a, holder.lora_b = lora.lora_a, lora.lora_b  # the adapter's own tensors, not the base
        trainable[key] = holder
    return trainable


def token_logprobs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[t] | tokens[:t+1]) for each position t."""
    logits = model(tokens.unsqueeze(0))[0].float()
    return torch.gather(F.log_softmax(logits, dim=-1), 1, targets.unsqueeze(1)).squeeze(1)


def datum_loss(loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Tinker's losses, summed over tokens: cross_entropy (weighted NLL), importance_sampling."""
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -(lp * weights).sum() if weights is not None else -lp.sum()
    if loss_fn == "importance_sampling":
        ratio = torch.exp(lp - inputs["logprobs"])
        return -(ratio * inputs["advantages"]).sum()
    raise ValueError(f"loss_fn {loss_fn!r} not supported")


@torch.no_grad()
def sample(model: nn.Module, prompt: np.ndarray, params: dict[str, Any], num_samples: int,
           seed: int, device: torch.device, max_len: int) -> list[tuple[np.ndarray, np.ndarray, str]]:
    """Autoregressive sampling with temperature/top-k/top-p, stop tokens and max_tokens; seeded."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    temperature = float(params.get("temperature", 1.0))
    top_k = int(params.get("top_k", -1))
    top_p = float(params.get("top_p", 1.0))
    max_tokens = int(params.get("max_tokens") or 16)
    stop = set(params.get("stop_tokens") or ())
    out = []
    for _ in range(num_samples):
        seq = torch.as_tensor(prompt, dtype=torch.long, device=device)
        toks: list[int] = []
        lps: list[float] = []
        reason = "length"
        for _step in range(max_tokens):
            if seq.numel() >= max_len:
                break
            logits = model(seq.unsqueeze(0))[0, -1].float().cpu()
            logp = F.log_softmax(logits, dim=-1)
            if temperature <= 0:
                nxt = int(torch.argmax(logp))
            else:
                scaled = logits / temperature
                if top_k > 0:
                    kth = torch.topk(scaled, min(top_k, scaled.numel())).values[-1]
                    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
                probs = F.softmax(scaled, dim=-1)
                if top_p < 1.0:
                    sp, idx = torch.sort(probs, descending=True)
                    keep = torch.cumsum(sp, 0) - sp < top_p
                    probs = torch.zeros_like(probs).scatter(0, idx[keep], sp[keep])
                nxt = int(torch.multinomial(probs, 1, generator=gen))
            toks.append(nxt)
            lps.append(float(logp[nxt]))
            seq = torch.cat([seq, torch.tensor([nxt], device=device)])
            if nxt in stop:
                reason = "stop"
                break
        out.append((np.asarray(toks, np.int32), np.asarray(lps, np.float32), reason))
    return out
