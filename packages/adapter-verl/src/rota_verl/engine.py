"""verl FSDP engines whose ``to()`` parks through rota_torch, registered for ``(cuda, nvidia)``.

Who uses it: verl itself. ``EngineRegistry.get_engine_cls`` looks up ``(device, vendor)`` before ``device``, so
these classes, registered under ``device="cuda", vendor="nvidia"``, replace verl's FSDP engines on NVIDIA
GPUs with no config change (every worker imports verl, which loads this plugin first).

verl moves an engine's state with ``to("cpu")`` / ``to("cuda")`` when a train or eval phase ends or starts
and offload is on (``fsdp_config.param_offload`` / ``optimizer_offload``). Here those moves are parks and
restores of a :class:`rota_torch.TensorParker` per tag (``weights``: parameters and buffers, ``grads``,
``optimizer``): the same storages are freed and refilled from one reused host pool (pinned), so the
module, its DTensor shards and the optimizer keep their tensors, and a restore is verified and bounded as
every rota restore. What verl moves itself outside ``to()`` (its checkpoint and weight-export paths call its
own offload functions) still works: those methods run with the state restored first, and a restore ends
with verl's own loader for anything verl had moved to the host its way.

Not parked through rota_torch: FSDP1 modules (flat parameters; verl's own offload runs) and forward-only
engines (verl keeps them on FSDP's CPU offload policy).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from verl.utils.fsdp_utils import fsdp_version
from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

from rota_torch import TensorParker, local_tensor

log = logging.getLogger(__name__)

__all__ = ["BACKENDS", "DEVICE", "RESIDENT_METHODS", "VENDOR", "RotaFSDPEngineWithLMHead",
           "RotaFSDPEngineWithValueHead", "RotaParking"]

BACKENDS = ["fsdp", "fsdp2"]
DEVICE, VENDOR = "cuda", "nvidia"
#: FSDPEngine methods that read or move the module's tensors outside ``to()``: they run with the state restored.
RESIDENT_METHODS = ("save_checkpoint", "load_checkpoint", "get_per_tensor_param", "get_per_tensor_param_shard",
                    "get_per_tensor_param_delta_shard")


class RotaParking:
    """The ``to()`` of a verl FSDP engine as rota_torch parks and restores (mixed in before verl's class)."""

    module: Any
    optimizer: Any
    engine_config: Any

    def rota_parkers(self) -> dict[str, TensorParker]:
        """tag -> this engine's parker (made on first use, on the device of the module's first parameter)."""
        parkers = getattr(self, "_rota_parkers", None)
        if parkers is None:
            device = next(self.module.parameters()).device
            module, name = self.module, f"verl/{type(self).__name__}"
            parkers = {
                "weights": TensorParker(device, name=f"{name}/weights"),
                "grads": TensorParker(device, name=f"{name}/grads"),
                "optimizer": TensorParker(device, name=f"{name}/optimizer"),
            }
            parkers["weights"].add("weights", lambda: [*module.named_parameters(), *module.named_buffers()])
            parkers["grads"].add("grads", lambda: [(n, p.grad) for n, p in module.named_parameters()
                                                   if p.grad is not None])
            parkers["optimizer"].add("optimizer", self._optimizer_tensors, on_discard="error")
            self._rota_parkers = parkers
        return parkers

    def _optimizer_tensors(self) -> list[tuple[str, torch.Tensor]]:
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None:
            return []
        return [(f"state.{i}.{key}", value) for i, state in enumerate(list(optimizer.state.values()))
                for key, value in state.items() if isinstance(value, torch.Tensor)]

    def rota_handles_module(self) -> bool:
        """Whether rota_torch parks this engine (plain and FSDP2 modules, not forward-only engines)."""
        return not getattr(self.engine_config, "forward_only", False) and fsdp_version(self.module) != 1

    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        BaseEngine.to(self, device=device, model=model, optimizer=optimizer, grad=grad)  # verl's argument check
        if not self.rota_handles_module():
            super().to(device=device, model=model, optimizer=optimizer, grad=grad)  # type: ignore[misc]
            return
        wanted = [tag for tag, on in (("weights", model), ("grads", grad), ("optimizer", optimizer)) if on]
        parkers = self.rota_parkers()
        if device == "cpu":
            for tag in wanted:
                parkers[tag].park()
            return
        for tag in ("weights", "optimizer", "grads"):  # weights first, as every rota restore
            if tag in wanted and parkers[tag].parked:
                parkers[tag].restore()
        if self._on_host(model, optimizer):  # what verl moved to the host its own way comes back its way
            super().to(device=device, model=model, optimizer=optimizer, grad=grad)  # type: ignore[misc]

    def _on_host(self, model: bool, optimizer: bool) -> bool:
        """Whether verl's own offload moved some of the state to the CPU (this engine's device being a GPU)."""
        if self.rota_parkers()["weights"].device.type == "cpu":
            return False
        tensors = [t for _, t in self.module.named_parameters()] if model else []
        tensors += [t for _, t in self._optimizer_tensors()] if optimizer else []
        return any(local_tensor(t).device.type == "cpu" for t in tensors)

    @contextlib.contextmanager
    def rota_resident(self) -> Iterator[None]:
        """Everything this engine parked is on the device inside; what was parked is parked again after."""
        if not self.rota_handles_module():
            yield
            return
        parked = [tag for tag, p in self.rota_parkers().items() if p.parked]
        for tag in ("weights", "optimizer", "grads"):
            if tag in parked:
                self.rota_parkers()[tag].restore()
        try:
            yield
        finally:
            for tag in parked:
                self.rota_parkers()[tag].park()  # nothing to move for what verl offloaded itself meanwhile


def _resident(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def run(self: RotaParking, *args: Any, **kwargs: Any) -> Any:
        with self.rota_resident():
            return method(self, *args, **kwargs)

    return run


def _rota_engine(base: type) -> type:
    """``base`` with :class:`RotaParking` first and its :data:`RESIDENT_METHODS` run with the state restored."""
    body: dict[str, Any] = {"__module__": __name__, "__doc__": f"verl's {base.__name__}, parked through rota_torch."}
    for name in RESIDENT_METHODS:
        if hasattr(base, name):
            body[name] = _resident(getattr(base, name))
    return type(f"Rota{base.__name__}", (RotaParking, base), body)


RotaFSDPEngineWithLMHead = EngineRegistry.register(
    model_type="language_model", backend=BACKENDS, device=DEVICE, vendor=VENDOR)(_rota_engine(FSDPEngineWithLMHead))
RotaFSDPEngineWithValueHead = EngineRegistry.register(
    model_type="value_model", backend=BACKENDS, device=DEVICE, vendor=VENDOR)(_rota_engine(FSDPEngineWithValueHead))
