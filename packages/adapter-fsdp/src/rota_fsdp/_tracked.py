"""``track()``: make a model's weights, grads and optimizer state parkable by rota.

Who calls it: the training script, once, after building the model and optimizer::

    gpu = rota.connect()
    tracked = rota_fsdp.track(gpu, model, optimizer)

:class:`FsdpTracked` is a :class:`rota_torch.Tracked` (registry, checks, guards, hooks,
verify/deadline/recreate, residue reports: see :mod:`rota_torch.tracked`) whose defaults
already park a plain module, DDP, or FSDP2's local shards. What is parked, per tag:

* ``weights`` — ``model.named_parameters()`` and ``named_buffers()``; for FSDP2 the
  local shard of each ``DTensor`` (each rank parks its own); for DDP the wrapped
  module's parameters. DDP's reducer buckets are not parked (the reducer owns them).
* ``grads`` — every ``param.grad`` present at park time. With ``discard=("grads",)``
  they are freed without copying and come back **zero-filled** (same tensors; call
  ``optimizer.zero_grad()`` as usual).
* ``optimizer`` — every tensor in ``optimizer.state``, re-read on each park because
  optimizers create their state lazily on the first step.

What this subclass adds is FSDP2's: before a park its modules are resharded
(``FSDPModule.reshard``) so no unsharded all-gather buffer stays on the device, and the
communication state FSDP2 keeps between iterations is dropped: the all-gather result
kept for the next forward and the reduce-scatter input kept so the allocator does not
reuse it too early (as large as the unsharded gradients; torch 2.11 kept it until the
next backward). Both are caches, waited on and then freed; FSDP2 re-creates them. A
residue report names FSDP2's per-parameter device buffers.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from rota import Gpu
from rota_torch import Tracked, local_tensor

__all__ = ["FsdpTracked", "track"]


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's FSDP2 modules. Without importing ``torch.distributed.fsdp`` (0.8 s on a CPU, about 3 s on a GPU
    host): it runs before every park, and a model made with ``fully_shard`` has imported it already."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None or not hasattr(fsdp, "FSDPModule"):  # not imported (so nothing is FSDP2), or torch without it
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def _fsdp_param_groups(state: Any) -> list[Any]:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.12: several per module
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def _wait_kept(kept: Any) -> None:
    """Order the current stream after the collective whose buffer ``kept`` holds (then it may be freed)."""
    event = getattr(kept, "event", None)
    if event is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().wait_event(event)


def _drop_fsdp_comm_state(modules: list[torch.nn.Module]) -> None:
    """Wait for and free the collective buffers FSDP2 keeps between iterations (caches, see module docs)."""
    for m in modules:
        state = m._get_fsdp_state()  # type: ignore[operator]
        ctx = getattr(state, "_comm_ctx", None)
        if ctx is None:
            continue
        if getattr(ctx, "all_gather_state", None) is not None:
            _wait_kept(ctx.all_gather_state)
            ctx.all_gather_state = None
        if getattr(ctx, "reduce_scatter_state", None) is not None:  # torch <= 2.11: one kept input
            _wait_kept(ctx.reduce_scatter_state)
            ctx.reduce_scatter_state = None
        for kept in getattr(ctx, "reduce_scatter_states", None) or []:  # torch >= 2.12: a list
            _wait_kept(kept)
        if getattr(ctx, "reduce_scatter_states", None):
            ctx.reduce_scatter_states.clear()
        for group in _fsdp_param_groups(state):
            if getattr(group, "_all_reduce_state", None) is not None:
                _wait_kept(group._all_reduce_state)
                group._all_reduce_state = None


def _fsdp_names(modules: list[torch.nn.Module]) -> dict[int, str]:
    """storage key -> name for FSDP2's per-parameter device buffers (unsharded parameter, all-gather output)."""
    out: dict[int, str] = {}
    for m in modules:
        for group in _fsdp_param_groups(m._get_fsdp_state()):  # type: ignore[operator]
            for fp in getattr(group, "fsdp_params", ()):
                info = getattr(fp, "_module_info", None)
                fqn = getattr(fp, "_param_fqn", None) or getattr(info, "param_name", "?")
                held = [("unsharded parameter", getattr(fp, "_unsharded_param", None))]
                held += [("all-gather buffer", t) for t in getattr(fp, "all_gather_outputs", None) or ()]
                for what, t in held:
                    if isinstance(t, torch.Tensor):
                        out[local_tensor(t).untyped_storage()._cdata] = f"FSDP2 {what} of {fqn}"
    return out


class FsdpTracked(Tracked):
    """A plain, DDP or FSDP2 model (and optimizer) that rota parks between the tenant's turns. Made by :func:`track`."""

    def before_park(self) -> None:
        """Free FSDP2's unsharded all-gather buffers and the collective buffers it keeps between iterations."""
        modules = _fsdp_modules(self.model)
        for m in modules:
            m.reshard()
        _drop_fsdp_comm_state(modules)

    def framework_buffers(self) -> dict[int, str]:
        """FSDP2's unsharded parameters and all-gather outputs, by parameter name."""
        return _fsdp_names(_fsdp_modules(self.model))


def track(gpu: Gpu, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
          **knobs: Any) -> FsdpTracked:
    """Make ``model`` (a module, DDP or FSDP2 model) and ``optimizer`` parkable for tenant ``gpu``.

    :param gpu: the tenant, from :func:`rota.connect`.
    :param model: the module whose parameters, buffers and grads are parked.
    :param optimizer: its optimizer; its state is parked under ``"optimizer"``.
    :param knobs: ``tags``, ``discard``, ``device``, ``pool_bytes``, ``release_cached``,
        ``verify``, ``deadline_s``, ``recreate``: those of :class:`rota_torch.Tracked`,
        the same for every torch adapter.
    :returns: the handle (``untrack()``, ``state_dict()``, ``footprint()``).
    :raises rota_torch.TrackingError: a bad tag, a device mismatch, or a model tracked twice.
    """
    return FsdpTracked(gpu, model, optimizer, **knobs)
