"""``track()``: make a Megatron-Core model (its chunks), DDP buffers and optimizer parkable.

Who calls it: the training script, once, after ``get_model`` / ``get_megatron_optimizer``::

    gpu = rota.connect()
    tracked = rota_megatron.track(gpu, model_chunks, optimizer)

:class:`MegatronTracked` is a :class:`rota_torch.Tracked`: the same hooks, guards,
errors, knobs and tenant registry as every torch adapter (a parameter tracked through
another one is refused here), and its parker parks by *distinct storage*. What it says
is only *which* tensors make up a Megatron job, per tag:

* ``weights`` — every chunk's parameters and buffers, and each Megatron DDP buffer's
  ``param_data`` (``buffers`` and ``expert_parallel_buffers`` of every chunk). With the
  DistributedOptimizer the parameters are views into ``param_data``: the parker sees
  one storage and parks the buffer once; the views stay valid because the same
  storage is resized back on restore.
* ``grads`` — each DDP buffer's ``grad_data`` (``param.main_grad`` are views of it),
  any ``param.grad``, and the optimizer's main-param grads (for bf16 models the
  DistributedOptimizer keeps fp32 copies; for fp32 ones they are views of
  ``grad_data``).
* ``optimizer`` — for each leaf of a Megatron optimizer (``ChainedOptimizer`` is
  walked): the inner torch optimizer's state and its parameters (the fp32 main params
  or their shards — each rank holds and parks its own shard), plus small device
  tensors the Megatron optimizer keeps (``found_inf``, grad-scaler scalars). A plain
  torch optimizer contributes its state.

Process groups are untouched (parking frees tensors only), so NCCL/gloo
communicators stay alive across a park. Not parked: CUDA graphs and NCCL
user-buffer registrations (``nccl_ub``), which capture raw addresses that a restore
changes — :func:`track` refuses ``nccl_ub``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from rota import Gpu
from rota_torch import AlreadyTracked, Tracked, TrackingError, align

__all__ = ["MegatronTracked", "ddp_buffers", "leaf_optimizers", "track"]

_ADAM_LIKE = ("Adam", "AdamW", "FusedAdam", "HybridDeviceOptimizer")


def ddp_buffers(chunk: torch.nn.Module) -> list[Any]:
    """Megatron DDP's ``_ParamAndGradBuffer`` objects of one chunk (none for an unwrapped chunk).

    Megatron DDP sets ``buffers`` and ``expert_parallel_buffers`` as list attributes;
    on any other module ``buffers`` is ``nn.Module.buffers``, a method.
    """
    out: list[Any] = []
    for attr in ("buffers", "expert_parallel_buffers"):
        value = chunk.__dict__.get(attr)
        if isinstance(value, (list, tuple)):
            out.extend(value)
    return out


def leaf_optimizers(optimizer: Any) -> list[Any]:
    """The non-chained optimizers inside ``optimizer`` (a ChainedOptimizer is walked recursively)."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [leaf for sub in chained for leaf in leaf_optimizers(sub)]
    return [optimizer]


def _inner(leaf: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer that holds the state: ``leaf`` itself, or a MegatronOptimizer's ``.optimizer``."""
    if isinstance(leaf, torch.optim.Optimizer):
        return leaf
    inner = getattr(leaf, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else None


def _main_params(leaf: Any) -> list[torch.Tensor]:
    inner = _inner(leaf)
    return [] if inner is None else [p for g in inner.param_groups for p in g["params"]]


def _device_scalars(leaf: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Small tensors a MegatronOptimizer keeps as attributes (``found_inf``, grad scaler state)."""
    if isinstance(leaf, torch.optim.Optimizer):
        return
    for owner_name, owner in (("", leaf), ("grad_scaler.", getattr(leaf, "grad_scaler", None))):
        for key, value in (vars(owner).items() if owner is not None else ()):
            if isinstance(value, torch.Tensor):
                yield f"{owner_name}{key}", value


class MegatronTracked(Tracked):
    """A Megatron-Core model (list of chunks) and optimizer that rota parks between turns.

    Made by :func:`track`. ``model`` is an ``nn.ModuleList`` over the chunks (for
    naming and registry bookkeeping only; the chunks are not modified);
    :attr:`chunks` is the list as given. Park, restore, guards and ``untrack`` are
    those of :class:`rota_torch.Tracked`.
    """

    def __init__(self, gpu: Gpu, model_chunks: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any = None,
                 **knobs: Any) -> None:
        self.chunks = _as_chunks(model_chunks, gpu)
        _check_inputs(optimizer, self.chunks, gpu)
        super().__init__(gpu, torch.nn.ModuleList(self.chunks), optimizer, **knobs)

    def describe(self) -> str:
        return f"megatron[{len(self.chunks)}]"

    def forward_modules(self) -> Sequence[torch.nn.Module]:
        return self.chunks  # the container is never called: guard each chunk's forward

    def device_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """What :meth:`weights` parks, each DDP buffer's ``grad_data``, and the optimizer's main params."""
        named = list(self.weights())
        named += [(f"chunk{i}.buffer{j}.grad_data", b.grad_data) for i, c in enumerate(self.chunks)
                  for j, b in enumerate(ddp_buffers(c)) if getattr(b, "grad_data", None) is not None]
        named += [(f"optimizer main param {m}", p) for leaf in leaf_optimizers(self.optimizer)
                  for m, p in enumerate(_main_params(leaf))]
        return named

    # ---------------------------------------------------------------- sources

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for i, chunk in enumerate(self.chunks):
            for j, buf in enumerate(ddp_buffers(chunk)):
                if getattr(buf, "param_data", None) is not None:
                    out.append((f"chunk{i}.buffer{j}.param_data", buf.param_data))
            out.extend((f"chunk{i}.{n}", t) for n, t in itertools.chain(chunk.named_parameters(),
                                                                          chunk.named_buffers()))
        return out

    def grads(self) -> Iterable[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for i, chunk in enumerate(self.chunks):
            for j, buf in enumerate(ddp_buffers(chunk)):
                if getattr(buf, "grad_data", None) is not None:
                    out.append((f"chunk{i}.buffer{j}.grad_data", buf.grad_data))
            for n, p in chunk.named_parameters():
                for attr in ("main_grad", "grad"):
                    g = getattr(p, attr, None)
                    if isinstance(g, torch.Tensor):
                        out.append((f"chunk{i}.{n}.{attr}", g))
        for k, leaf in enumerate(leaf_optimizers(self.optimizer)):
            for m, p in enumerate(_main_params(leaf)):
                if p.grad is not None:
                    out.append((f"opt{k}.main{m}.grad", p.grad))
        return out

    def optimizer_state(self) -> Iterable[tuple[str, torch.Tensor]]:
        out: list[tuple[str, torch.Tensor]] = []
        for k, leaf in enumerate(leaf_optimizers(self.optimizer)):
            params = _main_params(leaf)
            out.extend((f"opt{k}.main{m}", p) for m, p in enumerate(params))
            inner = _inner(leaf)
            if inner is not None:
                index = {id(p): m for m, p in enumerate(params)}
                for p, state in list(inner.state.items()):
                    for key, value in list(state.items()):
                        if isinstance(value, torch.Tensor):
                            out.append((f"opt{k}.state.{index.get(id(p), '?')}.{key}", value))
            out.extend((f"opt{k}.{n}", t) for n, t in _device_scalars(leaf))
        return out

    # ------------------------------------------------------------------ sizes

    def pool_estimate(self) -> int:
        """Bytes the pool needs at steady state, before the first step has made optimizer state.

        Resident storages now, plus for each Adam-like leaf without state two fp32
        moments per main param, plus ``.grad`` of parameters that Megatron DDP does not
        manage (no ``main_grad``): they appear at the first backward.
        """
        total = sum(align(s.nbytes()) for s, _, _ in self.parker.storages().values())
        for leaf in leaf_optimizers(self.optimizer):
            inner = _inner(leaf)
            params = _main_params(leaf)
            if "optimizer" in self.tags and inner is not None and not inner.state and \
                    type(inner).__name__ in _ADAM_LIKE:
                total += sum(2 * align(p.numel() * 4) + align(8) for p in params)
        if "grads" in self.tags and "grads" not in self.discard:  # plain autograd grads appear at the 1st backward
            total += sum(align(p.numel() * p.element_size()) for c in self.chunks for p in c.parameters()
                         if p.requires_grad and p.grad is None and getattr(p, "main_grad", None) is None)
        return total

    # -------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Like :meth:`rota_torch.Tracked.state_dict`, for a plain torch optimizer only.

        A Megatron optimizer's ``state_dict`` gathers shards across ranks (device work
        and collectives), so it cannot be written from the host copy of a parked
        tenant: restore it and use Megatron's distributed checkpointing instead.
        """
        if self.optimizer is not None and not isinstance(self.optimizer, torch.optim.Optimizer):
            raise TrackingError(f"tenant {self.gpu.tenant!r}: a {type(self.optimizer).__name__}'s state dict needs "
                                "the device and collectives; restore first and use Megatron's checkpointing",
                                job_id=self.gpu.tenant, group_id=self.gpu.group)
        return super().state_dict()


def _as_chunks(model_chunks: torch.nn.Module | Sequence[torch.nn.Module], gpu: Gpu) -> list[torch.nn.Module]:
    chunks = [model_chunks] if isinstance(model_chunks, torch.nn.Module) else list(model_chunks)
    if not chunks or not all(isinstance(c, torch.nn.Module) for c in chunks):
        raise TrackingError(f"tenant {gpu.tenant!r}: model_chunks must be a module or a non-empty list of modules "
                            f"(Megatron's get_model returns a list), got {type(model_chunks).__name__}",
                            job_id=gpu.tenant, group_id=gpu.group)
    if len({id(c) for c in chunks}) != len(chunks):
        raise AlreadyTracked(f"tenant {gpu.tenant!r}: the same chunk appears twice in model_chunks",
                             job_id=gpu.tenant, group_id=gpu.group)
    return chunks


def _check_inputs(optimizer: Any, chunks: list[torch.nn.Module], gpu: Gpu) -> None:
    for leaf in leaf_optimizers(optimizer):
        if _inner(leaf) is None and getattr(leaf, "optimizer", "absent") is not None:
            raise TrackingError(f"tenant {gpu.tenant!r}: cannot find optimizer state in {type(leaf).__name__}; "
                                "pass a torch optimizer or a Megatron optimizer (get_megatron_optimizer)",
                                job_id=gpu.tenant, group_id=gpu.group)
    if isinstance(optimizer, torch.optim.Optimizer):
        mine = {id(p) for c in chunks for p in c.parameters()}
        stray = sum(1 for p in _main_params(optimizer) if id(p) not in mine)
        if stray:
            raise TrackingError(f"tenant {gpu.tenant!r}: {stray} parameter(s) of the {type(optimizer).__name__} are "
                                "not in model_chunks; pass the optimizer built for these chunks",
                                job_id=gpu.tenant, group_id=gpu.group)
    for ddp_cfg in (getattr(c, "ddp_config", None) for c in chunks):
        if ddp_cfg is not None and getattr(ddp_cfg, "nccl_ub", False):
            raise TrackingError(f"tenant {gpu.tenant!r}: DDP with nccl_ub=True registers buffer addresses "
                                "with NCCL; a restore moves them. Build DDP with nccl_ub=False",
                                job_id=gpu.tenant, group_id=gpu.group)


def track(gpu: Gpu, model_chunks: torch.nn.Module | Sequence[torch.nn.Module], optimizer: Any = None,
          **knobs: Any) -> MegatronTracked:
    """Make a Megatron-Core model (its chunks), its DDP buffers and optimizer parkable for tenant ``gpu``.

    :param gpu: the tenant (this rank), from :func:`rota.connect`.
    :param model_chunks: the list from Megatron's ``get_model`` (one chunk per virtual
        pipeline stage; each a GPTModel, a ``Float16Module`` or a Megatron DDP), or one module.
    :param optimizer: a torch optimizer, or a Megatron optimizer (``DistributedOptimizer``,
        ``Float16OptimizerWithFloat16Params``, ``FP32Optimizer``, ``ChainedOptimizer`` of them).
    :param knobs: ``tags``, ``discard``, ``device``, ``pool_bytes``, ``release_cached``,
        ``verify``, ``deadline_s``, ``recreate``: those of :class:`rota_torch.Tracked`,
        the same for every torch adapter (``discard=("grads",)`` suits Megatron, which
        zeroes its grad buffers at the start of every step anyway).
    :returns: the :class:`MegatronTracked` handle.
    :raises rota_torch.TrackingError: bad tags, chunks or optimizer; ``DeviceMismatch`` for a
        tensor off the tenant's device; ``AlreadyTracked`` for a chunk or parameter tracked twice.
    """
    return MegatronTracked(gpu, model_chunks, optimizer, **knobs)
