"""The models behind the service: Hugging Face causal LMs (and a small test transformer), peft LoRA, losses
(sampling from them: :mod:`rota_tinker._worker.sampling`).

Imported only by worker processes (:mod:`rota_tinker._worker.main`); the HTTP process builds no
model (it still has torch loaded when torch is installed: the tinker SDK's types import it).
A Hugging Face model (:class:`rota_tinker._hf.HfModelSpec`) is built with
``transformers.AutoModelForCausalLM`` from its local snapshot, in the dtype its config names
(never downloaded); the test transformer :class:`TinyLM` is random-init from its seed or
loaded from a local file. Either way the same base model name gives the same weights in every
process, so a LoRA tenant's sampler can rebuild the base and load only the adapter. LoRA
adapters are ``peft``'s (:func:`add_lora`).

Everything here is deterministic on CPU (fixed seeds, one thread): a loop run alone and
the same loop run time-sliced beside another tenant give bit-identical losses.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rota_tinker._config import BaseModelSpec
from rota_tinker._hf import HfModelSpec

# LoRA target groups (the SDK's train_attn / train_mlp / train_unembed) -> leaf names of linears, per family
LORA_TARGETS = {"attn": ("q", "k", "v", "o", "q_proj", "k_proj", "v_proj", "o_proj"),
                "mlp": ("up", "down", "gate_proj", "up_proj", "down_proj"), "unembed": ("unembed", "lm_head")}
LORA_ALPHA = 32


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (m(h).view(b, t, self.heads, d // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)
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

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, **_: Any) -> torch.Tensor:
        """Logits of ``tokens`` ``[B, T]``; ``attention_mask`` (1: a real token) hides left padding, whose rows
        then take their positions from ``position_ids``."""
        pos = torch.arange(tokens.shape[-1], device=tokens.device) if position_ids is None else position_ids
        x = self.tok(tokens) + self.pos(pos)
        mask = None if attention_mask is None else _padded_causal(attention_mask.bool())
        for blk in self.blocks:
            x = blk(x, mask)
        return self.unembed(self.ln(x))


def _padded_causal(real: torch.Tensor) -> torch.Tensor:
    """``[B, 1, T, T]``: query t sees the real keys up to t (and itself, so a padding row is never all masked)."""
    t = real.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=real.device).tril()
    return ((causal & real[:, None, None, :]) | torch.eye(t, dtype=torch.bool, device=real.device))


def build_base(spec: BaseModelSpec | HfModelSpec, device: torch.device) -> nn.Module:
    """The base model: its weights from ``spec.path`` if given, else a function of ``spec.seed`` only."""
    if isinstance(spec, HfModelSpec):
        return _build_hf(spec, device)
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


def _hf_config(spec: HfModelSpec) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(spec.path, local_files_only=True)


def _build_hf(spec: HfModelSpec, device: torch.device) -> nn.Module:
    """``AutoModelForCausalLM`` from the snapshot, in the config's dtype (random-init from the seed without weights)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtype = getattr(torch, spec.dtype)
    if spec.has_weights:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=dtype, local_files_only=True, **_attention())
    else:  # initialised where it runs: one CPU thread takes minutes for billions of weights, a GPU a second
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
            torch.manual_seed(spec.seed)
            model = AutoModelForCausalLM.from_config(_hf_config(spec), dtype=dtype, **_attention())
    model = model.to(device).eval()
    if device.type == "cpu" and spec.has_weights:  # own storages, not the safetensors mapping: parking resizes them
        with torch.no_grad():
            for p in model.parameters():  # each Parameter once: tied weights stay one tensor
                p.data = p.data.clone()
            for m in model.modules():
                m._buffers.update({k: b.clone() for k, b in m._buffers.items() if b is not None})
    return model


def _attention() -> dict[str, str]:
    """With torch's deterministic algorithms on (``ServiceConfig.deterministic``), plain attention: the fused
    kernels' backward passes are not all deterministic on CUDA. Otherwise the model's default."""
    return {"attn_implementation": "eager"} if torch.are_deterministic_algorithms_enabled() else {}


def meta_model(spec: BaseModelSpec | HfModelSpec) -> nn.Module:
    """The model's modules on ``meta`` (no memory): :func:`rota_tinker._worker.holder.attach` points them at a
    shared copy."""
    with torch.device("meta"):
        if isinstance(spec, HfModelSpec):
            from transformers import AutoModelForCausalLM

            return AutoModelForCausalLM.from_config(_hf_config(spec), dtype=getattr(torch, spec.dtype),
                                                    **_attention()).eval()
        return TinyLM(spec)


def lora_config(model: nn.Module, rank: int, targets: dict[str, bool], leaves: set[str] | None = None) -> Any:
    """peft's ``LoraConfig`` for ``rank`` on the linears of the chosen groups that ``model`` has (``leaves``: their
    names, where its linears are wrapped, as in :class:`rota_tinker._worker.multilora.BatchedLora`)."""
    import peft

    if leaves is None:
        leaves = {name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    wanted = sorted({n for g, names in LORA_TARGETS.items() if targets.get(g) for n in names} & leaves)
    if not wanted:
        raise ValueError(f"no linear of {type(model).__name__} matches LoRA targets {targets}")
    return peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=wanted)


def add_lora(model: nn.Module, rank: int, seed: int, targets: dict[str, bool]) -> Any:
    """``model`` with peft LoRA adapters on the chosen groups (initialised from ``seed``): a ``peft.PeftModel``.

    The base's parameters are frozen; :func:`adapters_of` gives the adapters (what is trained and parked).
    """
    import peft

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return peft.get_peft_model(model, lora_config(model, rank, targets))


def _lora_layers(peft_model: Any) -> dict[str, Any]:
    """``peft_model``'s LoRA layers by the key :func:`adapters_of` gives each (its module name, dots as ``_``)."""
    from peft.tuners.lora import LoraLayer

    return {name.replace(".", "_"): (name, m) for name, m in peft_model.named_modules()
            if isinstance(m, LoraLayer) and "default" in m.lora_A}


def adapters_of(peft_model: Any) -> nn.ModuleDict:
    """The LoRA A/B linears of ``peft_model`` in one module (the same tensors: tracking this parks only them)."""
    trainable = nn.ModuleDict()
    for key, (_, m) in _lora_layers(peft_model).items():
        holder = nn.Module()
        holder.lora_A, holder.lora_B = m.lora_A["default"], m.lora_B["default"]
        trainable[key] = holder
    return trainable


def peft_state(peft_model: Any, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict of :func:`adapters_of` (``adapters``, e.g. its parked host copy) under ``peft_model``'s own
    keys: what ``peft_model.save_pretrained(folder, state_dict=...)`` writes as the adapter files."""
    names = {key: name for key, (name, _) in _lora_layers(peft_model).items()}
    out = {}
    for key, tensor in adapters.items():
        holder, layer, param = key.split(".", 2)  # LAYER_KEY.lora_A.weight
        out[f"{names[holder]}.{layer}.default.{param}"] = tensor
    return out


def lora_compute_dtype(model: nn.Module) -> torch.dtype | None:
    """The half precision (bf16/fp16) of ``model``'s frozen base that its LoRA layers compute in
    (:func:`lora_in_base_precision`), or None: an fp32 base, or no LoRA. Reads every parameter: a loop of
    forwards (decoding) asks once."""
    half = {p.dtype for p in model.parameters() if not p.requires_grad} & {torch.bfloat16, torch.float16}
    return half.pop() if len(half) == 1 and hasattr(model, "peft_config") else None


@contextlib.contextmanager
def lora_in_base_precision(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """Run ``model``'s LoRA layers in ``dtype`` (:func:`lora_compute_dtype` of it; None: as they are) with fp32
    adapter weights (AMP).

    Why: peft keeps adapters in fp32 and casts every LoRA layer's input to fp32, so the adapter matmuls
    run on CUDA cores with two casts around each: on an H200 that was about two thirds of a Qwen3-1.7B
    LoRA step's device time (``bench/results/lora-step-kernels-h200.json``). Under ``torch.autocast`` they
    run in the base's dtype; the adapters, their gradients and Adam state stay fp32. A model whose
    base is fp32 (or that has no LoRA) runs as it is.
    """
    if dtype is None:
        yield
        return
    from peft.helpers import disable_input_dtype_casting

    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=dtype), disable_input_dtype_casting(model):
        yield


def batch_logprobs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: log p(targets[b, t] | tokens[b, :t+1]) for a batch of sequences of one length."""
    with lora_in_base_precision(model, lora_compute_dtype(model)):
        out = model(tokens, use_cache=False)
    logits = (out.logits if hasattr(out, "logits") else out).float()
    return torch.gather(F.log_softmax(logits, dim=-1), 2, targets.unsqueeze(2)).squeeze(2)


def token_logprobs(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(targets[t] | tokens[:t+1]) for each position t."""
    return batch_logprobs(model, tokens.unsqueeze(0), targets.unsqueeze(0))[0]


# AdamParams' defaults (the tinker SDK's), for settings a step does not name
ADAM_DEFAULTS = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0, "grad_clip_norm": 0.0}


def adam_step(optimizer: torch.optim.Optimizer, adam: dict[str, float]) -> dict[str, Any]:
    """One optim_step: clip the gradients to ``grad_clip_norm`` (> 0), set the step's learning rate, betas, eps and
    weight decay, step, zero the gradients in place (their tensors stay, for parking); its metrics."""
    cfg = {**ADAM_DEFAULTS, **adam}
    norm = None
    if cfg["grad_clip_norm"] > 0:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        norm = float(torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip_norm"]))
    for group in optimizer.param_groups:
        group.update(lr=cfg["learning_rate"], betas=(cfg["beta1"], cfg["beta2"]), eps=cfg["eps"],
                     weight_decay=cfg["weight_decay"])
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    return {"metrics": {} if norm is None else {"grad_norm:mean": norm}}


# loss_fn -> its loss_fn_config keys and their defaults (the Tinker docs' values)
LOSS_CONFIG: dict[str, dict[str, float]] = {
    "cross_entropy": {}, "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "cispo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "gspo": {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
    "dro": {"beta": 0.05},
    "stable_reinforce": {"kl_coeff": 0.0},
}


def datum_loss(loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor],
               config: dict[str, float] | None = None) -> torch.Tensor:
    """Tinker's built-in losses, summed over tokens (formulas of the Tinker docs' "Loss functions")."""
    cfg = {**LOSS_CONFIG.get(loss_fn, {}), **(config or {})}
    if loss_fn == "cross_entropy":
        weights = inputs.get("weights")
        return -(lp * weights).sum() if weights is not None else -lp.sum()
    if loss_fn not in LOSS_CONFIG:
        raise ValueError(f"loss_fn {loss_fn!r} not supported")
    if loss_fn == "stable_reinforce":
        return stable_reinforce(lp, inputs["logprobs"], inputs["advantages"], inputs["sampled_mask"], cfg["kl_coeff"])
    sampled, adv = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(lp - sampled)
    if loss_fn == "importance_sampling":
        return -(ratio * adv).sum()
    if loss_fn == "dro":
        return -(lp * adv - 0.5 * cfg["beta"] * (lp - sampled) ** 2).sum()
    if loss_fn == "gspo":  # GSPO-token: each token carries the sequence ratio's value, its own logprob's gradient
        mask = inputs.get("sequence_ratio_mask")
        in_ratio = mask != 0 if mask is not None else torch.ones_like(lp, dtype=torch.bool)
        log_ratio = (lp.detach() - sampled)[in_ratio].mean() if bool(in_ratio.any()) else lp.new_zeros(())
        ratio = torch.exp(log_ratio + lp - lp.detach())
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    if loss_fn in ("ppo", "gspo"):
        return -torch.min(ratio * adv, clipped * adv).sum()
    return -(clipped.detach() * lp * adv).sum()  # cispo


def stable_reinforce(lp: torch.Tensor, sampler_lp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor,
                     kl_coeff: float) -> torch.Tensor:
    """StableReinforce as this service defines it (the Tinker docs do not publish the formula; the service README
    says what was assumed and why), over the rows where ``mask`` is 1 (target tokens that were sampled, their
    sampler logprob ``sampler_lp`` recorded at sampling time):

    ``-sum A * sg(min(r, 1)) * log p  +  kl_coeff * sum (r - 1 - log r)``, with ``r = p / q`` per token.

    The first term is REINFORCE with truncated importance weights: on-policy (r = 1) it is plain REINFORCE, and a
    stale or numerically different sampler can only shrink a token's weight, never blow it up. The second is the
    k3 estimate of KL(q || p) on the sampled tokens (>= 0 per token, gradient ``kl_coeff * (r - 1)`` per logprob),
    which pulls the learner back toward what was sampled.
    """
    on = mask != 0
    log_ratio = torch.where(on, lp - sampler_lp, torch.zeros_like(lp))
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, max=1.0).detach()
    policy = -(torch.where(on, weight * lp * adv, torch.zeros_like(lp))).sum()
    return policy + kl_coeff * torch.where(on, ratio - 1 - log_ratio, torch.zeros_like(lp)).sum()
