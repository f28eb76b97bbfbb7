"""Many tenants' LoRA adapters on one frozen base, trained in one batched pass.

Why: a LoRA step of one tenant leaves the device idle most of its wall time (Python launches
small kernels), and a process per tenant costs a CUDA context and its cache (11-13 GB each on an
H200). Here one process holds the base and every tenant's adapters; the queued units of many
tenants run as **one forward/backward over their concatenated rows**:

* the base's matmuls run once over the whole batch (its weights are frozen: no gradient, no
  cross-row sum anywhere, so a row's result depends only on that row);
* each tenant's LoRA A/B apply only to its own rows: a segment matmul over row ranges
  (``torch.nn.functional.grouped_mm`` on CUDA when every adapter of a layer has one rank and
  the sizes suit it; a loop of two small matmuls per tenant otherwise);
* each tenant's loss uses only its rows, so the backward of the summed loss gives every
  adapter exactly its own gradient; each tenant has its own AdamW (its own learning rate,
  betas, weight decay, clipping) over its own fp32 adapters.

One batch may mix ranks, targets, loss functions and sequence lengths (rows are right-padded to
the batch's longest with an attention mask; padded positions carry no loss). Adapters are fp32
leaves named as peft names them (``base_model.model.PATH.lora_A.weight``), so their state dicts
are peft's adapter files; on a half-precision base their matmuls run in the base's dtype.

:func:`plan_batches` decides what runs together: every tenant's oldest queued unit joins the
next batch (no tenant waits more than one batch), at most ``max_tenant_tokens`` of one tenant per
batch (a 100x larger unit is cut by datum into several batches instead of starving the others).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from rota_tinker._worker.kernels import exact_rms_norms, token_logprobs
from rota_tinker._worker.models import LORA_ALPHA, LORA_TARGETS, adam_step, datum_loss

__all__ = ["MICRO_TOKENS", "BatchedLora", "Unit", "plan_batches"]

# rows x length of one forward/backward, as the trainer's. On an H200 (Qwen3-1.7B) 16384 ran 8 tenants' tokens ~12%
# faster than two passes of 8192, but its activations and their cache took ~4.5 GB more per added tenant (the caching
# allocator keeps blocks of each pass size it saw), against ~0.5 GB at 8192
MICRO_TOKENS = 8192


@dataclass
class Unit:
    """One forward(_backward) request of one tenant: ``data`` is a list of (tokens, loss inputs) like the
    trainer's (``target_tokens`` and the loss function's arrays, all of the tokens' length)."""

    tenant: str
    data: list[tuple[Any, dict[str, Any]]]
    loss_fn: str = "cross_entropy"
    loss_config: dict[str, float] | None = None
    forward_only: bool = False
    key: Any = None  # the caller's name for the request this unit is (a part of)

    def tokens(self) -> int:
        return sum(len(t) for t, _ in self.data)


@dataclass
class _Adapter:
    """One tenant's adapters: module path -> (A ``[r, in]``, B ``[out, r]``), fp32 leaves, and its optimizer."""

    rank: int
    scale: float
    layers: dict[str, tuple[nn.Parameter, nn.Parameter]]
    optimizer: torch.optim.Optimizer = field(init=False)

    def __post_init__(self) -> None:
        params = self.parameters()  # fused on CUDA: one kernel for all of a tenant's tensors (foreach took ~8 ms)
        self.optimizer = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0,
                                           fused=bool(params) and params[0].is_cuda)

    def parameters(self) -> list[nn.Parameter]:
        return [p for pair in self.layers.values() for p in pair]


class _SegmentLora(nn.Module):
    """A frozen linear plus, for the batch being run, each tenant's LoRA on its own rows."""

    def __init__(self, base: nn.Linear, path: str, batched: BatchedLora) -> None:
        super().__init__()
        self.base, self.path = base, path
        self._batched = [batched]  # a list: not a submodule (BatchedLora is no nn.Module)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        segments = self._batched[0].segments
        if segments is None:
            return y
        flat = x.reshape(-1, x.shape[-1])
        per_row = flat.shape[0] // segments.rows
        delta = _segment_delta(flat, self.path, segments, per_row)
        return y + delta.view_as(y) if delta is not None else y


@dataclass
class _Segments:
    """The batch being run: row ranges ``[starts[i], starts[i+1])`` of ``adapters[i]``."""

    starts: list[int]
    adapters: list[_Adapter | None]  # None: rows of the bare base (a sample from the base model)
    grouped_ok: bool = True  # False: every segment through its own two matmuls (autograd; a reference)
    anchor: torch.Tensor | None = None  # an empty leaf needing grad: _GroupedLora's outputs then do too
    _grouped: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.starts[-1]

    def grouped(self, per_row: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``grouped_mm``'s group ends (token offsets) and each token's LoRA scale, made once per forward (every
        layer of it asks; built per layer they were four kernels and two host copies a layer)."""
        key = (per_row, dtype)
        if key not in self._grouped:
            bounds = [s * per_row for s in self.starts]
            offs = torch.tensor(bounds[1:], dtype=torch.int32).to(device, non_blocking=True)
            scale = torch.cat([torch.full((hi - lo, 1), ad.scale if ad is not None else 0.0, dtype=dtype)
                               for (lo, hi), ad in zip(itertools.pairwise(bounds), self.adapters, strict=True)])
            self._grouped[key] = (offs, scale.to(device, non_blocking=True))
        return self._grouped[key]


def _segment_delta(flat: torch.Tensor, path: str, seg: _Segments, per_row: int) -> torch.Tensor | None:
    """Each segment's ``scale * x A^T B^T`` for its rows of ``flat`` (``per_row`` tokens a row); None if no
    tenant of the batch adapts ``path``."""
    pairs = [a.layers.get(path) if a is not None else None for a in seg.adapters]
    if all(p is None for p in pairs):
        return None
    dtype = flat.dtype
    bounds = [s * per_row for s in seg.starts]
    ranks = {p[0].shape[0] for p in pairs if p is not None}
    if seg.grouped_ok and len(ranks) == 1 and all(p is not None for p in pairs) and _grouped_ok(flat, pairs, bounds):
        offs, scale = seg.grouped(per_row, flat.device, dtype)
        return _GroupedLora.apply(flat, seg.anchor, pairs, offs, scale)
    out_features = next(p for p in pairs if p is not None)[1].shape[0]
    pieces = []
    for (lo, hi), pair, adapter in zip(itertools.pairwise(bounds), pairs, seg.adapters, strict=True):
        if pair is None or hi == lo:
            pieces.append(flat.new_zeros(hi - lo, out_features))
        else:
            pieces.append((flat[lo:hi] @ pair[0].to(dtype).t()) @ pair[1].to(dtype).t() * adapter.scale)  # type: ignore[union-attr]
    return torch.cat(pieces)


def _grouped_ok(flat: torch.Tensor, pairs: Sequence[Any], bounds: Sequence[int]) -> bool:
    """Whether ``F.grouped_mm`` takes these sizes: bf16 on CUDA (any float on the CPU), 16-byte aligned strides
    and group sizes (the weight gradients contract over each group's tokens)."""
    if not hasattr(F, "grouped_mm") or (flat.is_cuda and flat.dtype != torch.bfloat16):
        return False
    r, n_in = pairs[0][0].shape
    n_out = pairs[0][1].shape[0]
    return all(d % 8 == 0 for d in (r, n_in, n_out)) and all((hi - lo) % 8 == 0 for lo, hi in
                                                            itertools.pairwise(bounds))


class _GroupedLora(torch.autograd.Function):
    """Every segment's ``scale * x A^T B^T`` in two grouped matmuls, forward and backward.

    Why a Function of its own: through autograd, each tenant's A and B of each layer is a node of its own
    (stacking, casting back, accumulating: about 8 kernels and their Python per tenant and layer, which
    made the step launch-bound). Here the adapters are not autograd inputs (an empty ``anchor`` leaf is, so the
    output needs a gradient even where ``flat`` does not, as in the first layer): the backward computes every
    tenant's A and B gradients of the layer as two grouped matmuls and adds them to their fp32 ``.grad``
    with one foreach add. A row's gradient still depends only on its own tenant's rows.
    """

    @staticmethod
    def forward(ctx: Any, flat: torch.Tensor, anchor: torch.Tensor | None, pairs: list[tuple[nn.Parameter, ...]],
                offs: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        a = torch.stack([p[0].detach() for p in pairs]).to(flat.dtype)  # [G, r, in]
        b = torch.stack([p[1].detach() for p in pairs]).to(flat.dtype)  # [G, out, r]
        mid = F.grouped_mm(flat, a.transpose(1, 2), offs=offs) * scale  # [T, r]
        ctx.save_for_backward(flat, mid, a, b, offs, scale)
        ctx.pairs = pairs
        return F.grouped_mm(mid, b.transpose(1, 2), offs=offs)  # [T, out]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None, None, None]:
        flat, mid, a, b, offs, scale = ctx.saved_tensors
        grad = grad.contiguous()
        # [G, out, r]: each group's grad^T mid, as (mid^T grad)^T so that the copy made contiguous is the
        # r-wide mid, not the out-wide grad (that copy was ~17% of a step's device time on the H100)
        grad_b = F.grouped_mm(mid.t().contiguous(), grad, offs=offs).transpose(1, 2)
        grad_mid = F.grouped_mm(grad, b, offs=offs) * scale  # [T, r]
        grad_a = F.grouped_mm(grad_mid.t().contiguous(), flat, offs=offs)  # [G, r, in]
        params = [p for pair in ctx.pairs for p in pair]
        grads = [g for ga, gb in zip(grad_a.float().unbind(0), grad_b.float().unbind(0), strict=True)
                 for g in (ga, gb)]
        if len({id(p) for p in params}) == len(params):
            torch._foreach_add_([p.grad for p in params], grads)
        else:  # a tenant in several segments (units not next to each other): no foreach over one tensor twice
            for p, g in zip(params, grads, strict=True):
                p.grad.add_(g)
        grad_flat = F.grouped_mm(grad_mid, a, offs=offs) if ctx.needs_input_grad[0] else None  # [T, in]
        return grad_flat, None, None, None, None


class BatchedLora:
    """A frozen base model with any number of tenants' LoRA adapters, run in batches (see the module docs).

    :param model: the base (its parameters are frozen here); its linears whose leaf name is in
        :data:`rota_tinker._worker.models.LORA_TARGETS` take adapters.
    :param device: where adapters live (the base's device).
    """

    def __init__(self, model: nn.Module, device: torch.device | str) -> None:
        self.model, self.device = model, torch.device(device)
        for p in model.parameters():
            p.requires_grad_(False)
        self.adapters: dict[str, _Adapter] = {}
        self.segments: _Segments | None = None
        self.grouped = True  # False: the reference path (each segment's two matmuls through autograd)
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)  # see _GroupedLora
        wanted = {n for names in LORA_TARGETS.values() for n in names}
        self.linears: dict[str, tuple[str, nn.Linear]] = {}  # path -> (target group, linear)
        exact_rms_norms(model)  # fused norms where they equal the model's own (rota_tinker._worker.kernels)
        for path, module in list(model.named_modules()):
            leaf = path.rpartition(".")[2]
            if isinstance(module, nn.Linear) and leaf in wanted:
                group = next(g for g, names in LORA_TARGETS.items() if leaf in names)
                self.linears[path] = (group, module)
                parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
                setattr(parent, leaf, _SegmentLora(module, path, self))

    # ------------------------------------------------------------------ tenants

    def add(self, tenant: str, rank: int, seed: int, targets: dict[str, bool], alpha: float = LORA_ALPHA) -> int:
        """Give ``tenant`` fresh adapters on the linears of the chosen groups, as peft starts them from ``seed``
        (:func:`rota_tinker._worker.models.add_lora`: the same random draws in the same order, so A is the same
        kaiming-uniform and B zeros); returns their parameter count."""
        if tenant in self.adapters:
            raise ValueError(f"tenant {tenant!r} already has adapters on this base")
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank={rank!r} must be a positive integer")
        chosen = {p: lin for p, (g, lin) in self.linears.items() if targets.get(g)}  # in module order, as peft
        if not chosen:
            raise ValueError(f"no linear of {type(self.model).__name__} matches LoRA targets {targets}")
        gen = torch.Generator().manual_seed(seed)
        layers = {}
        for path, lin in chosen.items():
            a = torch.empty(rank, lin.in_features)
            b = torch.empty(lin.out_features, rank)
            bound = 1 / math.sqrt(lin.in_features)  # kaiming_uniform_(a=sqrt(5)) of an [r, in] weight
            a.uniform_(-bound, bound, generator=gen)  # peft makes nn.Linear(in, r) and nn.Linear(r, out): their
            b.uniform_(-1 / math.sqrt(rank), 1 / math.sqrt(rank), generator=gen)  # own inits draw first, then
            a.uniform_(-bound, bound, generator=gen)  # it draws A again (kaiming) and zeros B
            pair = (nn.Parameter(a.to(self.device)), nn.Parameter(torch.zeros(lin.out_features, rank,
                                                                                device=self.device)))
            for p in pair:  # the grouped backward adds into them (see _GroupedLora); zero_grad keeps them
                p.grad = torch.zeros_like(p)
            layers[path] = pair
        self.adapters[tenant] = _Adapter(rank, alpha / rank, layers)
        return sum(p.numel() for p in self.adapters[tenant].parameters())

    def load(self, tenant: str, state: dict[str, torch.Tensor]) -> None:
        """Set ``tenant``'s adapters in place from peft's adapter file names (what :meth:`state_dict` gives; other
        tensors peft writes there, such as a targeted unembedding's frozen base weight, are not adapters).

        :raises ValueError: ``state`` lacks one of its adapters, has others, or a shape differs.
        """
        mine = self.state_dict(tenant)
        state = {k: v for k, v in state.items() if ".lora_" in k}
        if set(mine) != set(state):
            raise ValueError(f"the adapters do not fit this model: missing {sorted(set(mine) - set(state))[:4]}, "
                             f"unexpected {sorted(set(state) - set(mine))[:4]}")
        with torch.no_grad():
            for path, (a, b) in self.adapters[tenant].layers.items():
                for name, p in (("lora_A", a), ("lora_B", b)):
                    src = state[f"base_model.model.{path}.{name}.weight"]
                    if tuple(src.shape) != tuple(p.shape):
                        raise ValueError(f"{path}.{name} is {tuple(src.shape)} in the file, {tuple(p.shape)} here")
                    p.copy_(src.to(p.dtype))

    def optimizer_state(self, tenant: str) -> dict[str, Any]:
        """``tenant``'s AdamW state as a trainer's ``optimizer.pt`` holds it: step counts on the host, not fused
        (a fused optimizer keeps them on the device and says so in its groups, which a trainer would inherit)."""
        state = self.adapters[tenant].optimizer.state_dict()
        for group in state["param_groups"]:
            group["fused"] = None
        state["state"] = {k: {**v, "step": v["step"].cpu()} if "step" in v else dict(v)
                          for k, v in state["state"].items()}
        return state

    def load_optimizer_state(self, tenant: str, state: dict[str, Any] | None) -> None:
        """Load a trainer's or a BatchedLora's ``optimizer.pt`` into ``tenant``'s AdamW (None: a fresh state), which
        stays as it was made (fused on CUDA)."""
        opt = self.adapters[tenant].optimizer
        if state is None:
            opt.state.clear()
            return
        fused = opt.param_groups[0].get("fused")
        opt.load_state_dict(state)
        for group in opt.param_groups:
            group["fused"] = fused
        if fused:
            for st in opt.state.values():
                if "step" in st:
                    st["step"] = st["step"].to(self.device, torch.float32)

    def remove(self, tenant: str) -> None:
        self.adapters.pop(tenant, None)

    def state_dict(self, tenant: str) -> dict[str, torch.Tensor]:
        """``tenant``'s adapters under peft's names (``base_model.model.PATH.lora_A.weight``), on the host."""
        out = {}
        for path, (a, b) in self.adapters[tenant].layers.items():
            out[f"base_model.model.{path}.lora_A.weight"] = a.detach().cpu().clone()
            out[f"base_model.model.{path}.lora_B.weight"] = b.detach().cpu().clone()
        return out

    # ------------------------------------------------------------------- a batch

    @contextlib.contextmanager
    def _running(self, segments: _Segments) -> Iterator[None]:
        self.segments = segments
        try:
            yield
        finally:
            self.segments = None

    def forward_backward(self, units: Sequence[Unit], micro_tokens: int = MICRO_TOKENS) -> list[dict[str, Any]]:
        """Run ``units`` (of different tenants, or several of one) as one batch; each gets its per-datum
        logprobs and ``loss:sum``, and (unless ``forward_only``) its adapters' gradients accumulate its loss's.

        The rows go through in micro-batches of at most ``micro_tokens`` (rows x their longest; at least one row):
        each holds the rows of several tenants and has its own backward (logits are what takes the memory).
        """
        rows = [(u, i) for u, unit in enumerate(units) for i in range(len(unit.data))]
        parts: list[list[tuple[int, int]]] = [[]]
        longest = 0
        for u, i in rows:
            n = len(units[u].data[i][0])
            if parts[-1] and (len(parts[-1]) + 1) * max(longest, n) > micro_tokens:
                parts.append([])
                longest = 0
            parts[-1].append((u, i))
            longest = max(longest, n)
        losses = [0.0] * len(units)
        logprobs: list[list[Any]] = [[None] * len(unit.data) for unit in units]
        for part in parts:
            if part:
                self._micro(units, part, losses, logprobs)
        return [{"logprobs": lp, "metrics": {"loss:sum": loss}} for lp, loss in zip(logprobs, losses, strict=True)]

    def _micro(self, units: Sequence[Unit], part: list[tuple[int, int]], losses: list[float],
               logprobs: list[list[Any]]) -> None:
        """One micro-batch: its rows (unit, datum) in unit order, one forward, one backward.

        Every row's loss inputs reach the device in one copy, cross-entropy rows take their losses in one
        vectorised sum, and the results come back in one copy queued before the backward: no wait on the
        device between the forward and the backward (a copy per row had waited for the whole forward each time).
        """
        longest = max(len(units[u].data[i][0]) for u, i in part)
        tokens = torch.zeros(len(part), longest, dtype=torch.long)
        targets = torch.zeros(len(part), longest, dtype=torch.long)
        real = torch.zeros(len(part), longest, dtype=torch.long)
        keys = sorted({k for u, i in part for k in units[u].data[i][1] if k != "target_tokens"})
        arrays = torch.zeros(len(keys), len(part), longest)  # each loss input, rows right-padded with zeros
        has = torch.zeros(len(keys), len(part), dtype=torch.bool)
        starts, owners = [0], []
        for r, (u, i) in enumerate(part):
            toks, ins = units[u].data[i]
            tokens[r, :len(toks)] = torch.as_tensor(toks, dtype=torch.long)
            targets[r, :len(toks)] = torch.as_tensor(ins["target_tokens"], dtype=torch.long)
            real[r, :len(toks)] = 1
            for k, key in enumerate(keys):
                if key in ins:
                    arrays[k, r, :len(toks)] = torch.as_tensor(ins[key], dtype=torch.float32)
                    has[k, r] = True
            if owners and owners[-1] == u:
                starts[-1] = r + 1
            else:
                owners.append(u)
                starts.append(r + 1)
        segments = _Segments(starts, [self.adapters[units[u].tenant] for u in owners], grouped_ok=self.grouped,
                             anchor=self._anchor)
        pinned = self.device.type == "cuda"
        tokens, targets, real, arrays, has = (self._put(t) for t in (tokens, targets, real, arrays, has))
        train = not all(units[u].forward_only for u, _ in part)
        with self._running(segments), torch.enable_grad() if train else torch.no_grad():
            out = self.model(tokens, attention_mask=real, use_cache=False)
            lp = token_logprobs(out.logits if hasattr(out, "logits") else out, targets)
            del out
            row_loss, total = self._losses(units, part, lp, real, keys, arrays, has)
            host_lp = lp.detach().to("cpu", non_blocking=pinned)
            host_loss = row_loss.detach().to("cpu", non_blocking=pinned)
        if total is not None:
            total.backward()
        if pinned:
            torch.cuda.current_stream(self.device).synchronize()
        host_lp_np, host_loss_list = host_lp.numpy(), host_loss.tolist()
        for r, (u, i) in enumerate(part):
            losses[u] += host_loss_list[r]
            logprobs[u][i] = host_lp_np[r, :len(units[u].data[i][0])].copy()

    def _losses(self, units: Sequence[Unit], part: list[tuple[int, int]], lp: torch.Tensor, real: torch.Tensor,
                keys: list[str], arrays: torch.Tensor, has: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's loss (``[rows]``) and the sum to differentiate (None: every row is forward-only). Rows of
        ``cross_entropy`` take ``-sum(lp * weights)`` together (padding has weight 0; no weights: 1 on real
        tokens); other loss functions go row by row through :func:`rota_tinker._worker.models.datum_loss`."""
        rows = len(part)
        trained = [r for r, (u, _) in enumerate(part) if not units[u].forward_only]
        if 0 < len(trained) < rows:  # forward-only rows: no gradient path at all (their inputs may be anything)
            mask = torch.zeros(rows, 1, dtype=torch.bool)
            mask[trained] = True
            lp = torch.where(self._put(mask), lp, lp.detach())
        ce = [units[u].loss_fn == "cross_entropy" for u, _ in part]
        row_loss = lp.new_zeros(rows)
        if any(ce):
            weights = real.float()
            if "weights" in keys:
                k = keys.index("weights")
                weights = torch.where(has[k].unsqueeze(1), arrays[k], weights)
            row_loss = -(lp * weights).sum(1)
        others = []
        for r, (u, i) in enumerate(part):
            if not ce[r]:
                n = len(units[u].data[i][0])
                ins = {key: arrays[k, r, :n] for k, key in enumerate(keys) if key in units[u].data[i][1]}
                others.append((r, datum_loss(units[u].loss_fn, lp[r, :n], ins, units[u].loss_config)))
        if others:
            index = self._put(torch.tensor([r for r, _ in others]))
            row_loss = row_loss.index_put((index,), torch.stack([loss for _, loss in others]))
        # forward-only rows add only to the value: the where() above left them no path back to the model
        return row_loss, row_loss.sum() if trained else None

    def _put(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device without waiting for it: through pinned memory on CUDA."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def decoding(self, requests: Sequence[dict[str, Any]], max_len: int, tokenizer: Any = None) -> Any:
        """The sample requests of many tenants as one decode batch (a :class:`rota_tinker._worker.sampling.Decoding`,
        run a step at a time), each row with its own tenant's adapters.

        A request is what :func:`rota_tinker._worker.sampling.sample` takes, plus ``tenant`` (None: the bare base);
        its ``num_samples`` rows are one segment. The adapters must stay until the decoding is done.
        """
        from rota_tinker._worker.sampling import Decoding

        starts = [0]
        for r in requests:
            starts.append(starts[-1] + r["num_samples"])
        segments = _Segments(starts, [self.adapters[r["tenant"]] if r.get("tenant") else None for r in requests])
        return Decoding(self.model, list(requests), self.device, max_len, tokenizer,
                        around=lambda: self._running(segments))

    def sample(self, requests: Sequence[dict[str, Any]], max_len: int, tokenizer: Any = None) -> list[Any]:
        """Decode the requests of :meth:`decoding` to their end; each result is what
        :func:`rota_tinker._worker.sampling.sample` gives (or the exception that failed that request alone)."""
        decoding = self.decoding(requests, max_len, tokenizer)
        while not decoding.done:
            decoding.step()
        return decoding.results()

    def optim_step(self, tenant: str, adam: dict[str, float]) -> dict[str, Any]:
        """``tenant``'s AdamW step with its own settings (:func:`rota_tinker._worker.models.adam_step`)."""
        return adam_step(self.adapters[tenant].optimizer, adam)


def plan_batches(queue: Sequence[Unit], max_tenant_tokens: int, max_batch_tokens: int) -> list[list[Unit]]:
    """Split the queued units (oldest first) into batches: each batch takes every tenant's oldest pending unit
    (so no tenant waits more than one batch), at most ``max_tenant_tokens`` of one tenant (a larger unit is
    cut by datum; its parts run in consecutive batches) and, past the first unit, at most ``max_batch_tokens``
    in all. A tenant a full batch left out goes first in the next: with ``max_batch_tokens`` at least the
    tenants times ``max_tenant_tokens``, every tenant with work is in every batch."""
    if max_tenant_tokens < 1 or max_batch_tokens < 1:
        raise ValueError("token bounds must be >= 1")
    pending: dict[str, list[Unit]] = {}
    for unit in queue:  # a unit larger than the tenant's share is cut into parts by datum
        part: list[tuple[Any, dict[str, Any]]] = []
        for datum in unit.data:
            if part and sum(len(t) for t, _ in part) + len(datum[0]) > max_tenant_tokens:
                pending.setdefault(unit.tenant, []).append(dataclasses.replace(unit, data=part))
                part = []
            part.append(datum)
        pending.setdefault(unit.tenant, []).append(dataclasses.replace(unit, data=part))
    batches = []
    order = list(pending)  # tenants left out of a batch (it was full) come first in the next one
    while any(pending.values()):
        batch, size, left = [], 0, []
        for tenant in order:
            if not pending[tenant]:
                continue
            unit = pending[tenant][0]
            if batch and size + unit.tokens() > max_batch_tokens:
                left.append(tenant)
                continue
            batch.append(pending[tenant].pop(0))
            size += unit.tokens()
        order = left + [t for t in order if t not in left]
        batches.append(batch)
    return batches
