"""``track()``: make a model's weights, grads and optimizer state parkable by rota.

Who calls it: the training script, once, after building the model and optimizer::

    gpu = rota.connect()
    tracked = rota_fsdp.track(gpu, model, optimizer)

``track`` registers one plugin object per tracked model on ``gpu.pm``; it answers
``rota_park``/``rota_restore``/``rota_footprint`` only for that ``gpu`` (several
tenants may share one process and one plugin manager). The moving itself is done by
:class:`rota.tensors.TensorParker` (by distinct storage, identities kept, one pinned
pool sized here and allocated in the background).

What is parked, per tag:

* ``weights`` — ``model.named_parameters()`` and ``named_buffers()``; for FSDP2 the
  local shard of each ``DTensor`` (each rank parks its own); for DDP the wrapped
  module's parameters. FSDP2 modules are resharded first (``FSDPModule.reshard``) so
  no unsharded all-gather buffer stays on the device, and the communication state
  FSDP2 keeps between iterations is dropped: the all-gather result kept for the next
  forward and the reduce-scatter input kept so the allocator does not reuse it too
  early (as large as the unsharded gradients; torch 2.11 kept it until the next
  backward). Both are caches, waited on and then freed; FSDP2 re-creates them. DDP's
  reducer buckets are not parked (the reducer owns them).
* ``grads`` — every ``param.grad`` present at park time. With ``discard=("grads",)``
  they are freed without copying and come back **zero-filled** (same tensors; call
  ``optimizer.zero_grad()`` as usual).
* ``optimizer`` — every tensor in ``optimizer.state``, re-read on each park because
  optimizers create their state lazily on the first step.

Switch guarantees (see :mod:`rota.tensors`): every park reports its residue —
tracked tags still on the device, and ``untracked:MODULE.ATTR`` for tensors hanging off
the model's modules on its device that are neither parameters nor buffers (a
"forgotten" tensor), plus allocator totals on CUDA; the client faults the park when
the residue passes ``ROTA_RESIDUE_MAX_BYTES``. When the allocator holds much more than
that names, every live tensor on the device that no tracked model parks is named by
who holds it (:func:`rota.tensors.name_untracked`). On CUDA the park also reports the
process's bytes outside torch's allocator (NVML: CUDA context, NCCL communicators,
library handles) as ``process:outside_allocator``, and how much that grew since
``track`` as ``process:outside_allocator_growth`` (in a distributed job, mostly NCCL);
neither counts against the limit: communicators stay alive across parks. Restores are verified (``verify=``),
bounded (``deadline_s=``) and refused without room. A discarded ``weights`` or
``optimizer`` tag must be re-created by a ``recreate={"weights": fn}`` callback, or the
restore fails naming it; discarded ``grads`` come back zero-filled.

Invariants enforced here (each a clear error): one device per tenant, a model or
parameter is tracked once, no park while a backward pass through the model is in
flight or while the tenant holds its turn, no forward while parked.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from rota import Gpu, ParkMode, ParkPlan, ParkResult, hookimpl
from rota.errors import InvalidArgument, TransientError
from rota.tensors import TensorParker, align, local_tensor, name_untracked, outside_allocator_bytes

log = logging.getLogger(__name__)

TAGS = ("weights", "grads", "optimizer")
# An idle resident keeps at most this share of the device in torch's cache of freed blocks (the step's
# temporaries, e.g. AdamW's foreach buffers): more goes back to the driver when its turn ends, for the next holder.
IDLE_CACHE_SHARE = 0.05
NAME_UNEXPLAINED_ABOVE = 128 << 20  # allocator bytes beyond the named residue that make a park name every tensor
_ADAM_LIKE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam")


class TrackingError(InvalidArgument):
    """``track`` was called with inputs rota cannot park safely."""


class DeviceMismatch(TrackingError):
    """The model is not on the tenant's device, or its tensors span several devices."""


class AlreadyTracked(TrackingError):
    """The model (or one of its parameters) is already tracked."""


class HoldsTurn(InvalidArgument):
    """Park was asked while the tenant holds its turn."""


class BackwardInFlight(TransientError):
    """Park was asked while a backward pass through the tracked model runs; retry after it."""


_lock = threading.Lock()
_models: dict[int, Tracked] = {}  # id(model) -> Tracked; the Tracked keeps the model alive until untrack()
_params: dict[int, tuple[weakref.ref[torch.Tensor], Tracked]] = {}  # id(param) -> (param, owner)
_devices: weakref.WeakKeyDictionary[Gpu, torch.device] = weakref.WeakKeyDictionary()


def _norm_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in a forward output: a tensor, or lists/tuples/dicts (and dataclass-like) of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)


def _fsdp_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch built without distributed
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


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


class _TenantPlugin:
    """The hook implementations of one tracked model, answering only for its own Gpu."""

    def __init__(self, tracked: Tracked) -> None:
        self.tracked = tracked

    @hookimpl
    def rota_park(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.tracked.gpu:
            return None
        return self.tracked.park(plan)

    @hookimpl
    def rota_restore(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.tracked.gpu:
            return None
        return self.tracked.restore(plan)

    @hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        if tenant is not self.tracked.gpu:
            return None
        return self.tracked.footprint()

    @hookimpl
    def rota_turn_ended(self, tenant: Gpu, grant: object, seconds: float) -> None:
        if tenant is self.tracked.gpu:
            self.tracked.trim_cache()


class Tracked:
    """A model (and optimizer) whose device state rota parks between the tenant's turns.

    Made by :func:`track`. The orchestrator drives :meth:`park` and :meth:`restore`
    through the Gpu's hooks; call them directly only in benchmarks and tests (a direct
    park leaves ``gpu.parked`` unset, so prefer ``gpu.park()``).
    """

    def __init__(self, gpu: Gpu, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 tags: tuple[str, ...], discard: frozenset[str], device: torch.device, release_cached: bool,
                 verify: str | None = None, deadline_s: float | None = None,
                 recreate: dict[str, Callable[[], None]] | None = None) -> None:
        self.gpu, self.model, self.optimizer = gpu, model, optimizer
        self.tags, self.discard, self.device = tags, discard, device
        self.parker = TensorParker(device, release_cached=release_cached,
                                   name=f"{gpu.tenant}/{type(model).__name__}", verify=verify, deadline_s=deadline_s)
        recreate = recreate or {}
        # Order sets ownership of shared storages: weights, then optimizer, then grads.
        for tag in ("weights", "optimizer", "grads"):
            if tag in tags:
                self.parker.add(tag, getattr(self, f"_{tag}"),
                                on_discard=recreate.get(tag, "zeros" if tag == "grads" else "error"))
        self._backward_depth = 0
        self._plugin = _TenantPlugin(self)
        self._plugin_name = f"rota_fsdp:{gpu.tenant}:{gpu.rank}:{id(self):x}"
        self._hooks = [model.register_forward_pre_hook(self._before_forward),
                       model.register_forward_hook(self._after_forward)]
        # Outside-allocator bytes now, before this job's collectives ran: their growth is NCCL's.
        self._outside_at_track = outside_allocator_bytes(device) if device.type == "cuda" else None
        self.active = True

    # ---------------------------------------------------------------- sources

    def _weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        return itertools.chain(self.model.named_parameters(), self.model.named_buffers())

    def _grads(self) -> Iterable[tuple[str, torch.Tensor]]:
        return ((n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None)

    def _optimizer(self) -> Iterable[tuple[str, torch.Tensor]]:
        if self.optimizer is None:
            return ()
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        out = []
        for p, state in list(self.optimizer.state.items()):
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"state.{index.get(id(p), '?')}.{key}", value))
        return out

    # ---------------------------------------------------------- backward guard

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        if self.parker.parked:
            raise RuntimeError(f"model {type(module).__name__} of tenant {self.gpu.tenant!r} is parked: run it "
                               "inside `with gpu.turn():` (which restores it) or call tracked.restore() first")
        self._backward_depth = 0  # a new forward: any earlier backward has ended (even one that raised)

    def _after_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        for t in _tensors_in(output):
            if t.requires_grad and t.grad_fn is not None:
                t.register_hook(self._on_backward)

    def _on_backward(self, grad: torch.Tensor) -> None:
        self._backward_depth += 1
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._backward_depth -= 1

    @property
    def backward_in_flight(self) -> bool:
        """True while a backward pass through the tracked model runs."""
        return self._backward_depth > 0

    # ------------------------------------------------------------ park/restore

    @property
    def parked(self) -> bool:
        """True between a park and the next restore."""
        return self.parker.parked

    def park(self, plan: ParkPlan | None = None) -> ParkResult:
        """Move this model's state named by ``plan`` to the host pool (or drop discarded tags).

        :raises HoldsTurn: the tenant holds its turn.
        :raises BackwardInFlight: a backward pass through the model is running.
        """
        tags, drop = self._park_args(plan)
        self._reshard()
        result = self.parker.park(tags, drop)
        result.residue.update(self.untracked_residue())
        if self.device.type == "cuda":
            result.residue.update(self._unexplained_residue(result.residue))
            outside = outside_allocator_bytes(self.device)
            if outside is not None:
                result.residue["process:outside_allocator"] = outside
                if self._outside_at_track is not None:
                    result.residue["process:outside_allocator_growth"] = max(0, outside - self._outside_at_track)
        return result

    def trim_cache(self) -> None:
        """After a turn: give torch's cached free blocks back to the driver if they exceed :data:`IDLE_CACHE_SHARE`.

        The tenant stays resident (nothing is parked); the next holder gets room for its
        own temporaries. Small caches are kept: reallocating them every turn costs time.
        """
        if self.device.type != "cuda" or not self.parker.release_cached:
            return
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if cached > IDLE_CACHE_SHARE * torch.cuda.get_device_properties(self.device).total_memory:
            torch.cuda.empty_cache()

    def _unexplained_residue(self, residue: dict[str, int]) -> dict[str, int]:
        """Name every untracked live tensor when the allocator holds far more than the residue named so far."""
        named = sum(n for k, n in residue.items() if not k.startswith("process:"))
        if residue.get("process:allocated", 0) - named <= NAME_UNEXPLAINED_ABOVE:
            return {}
        with _lock:
            others = [t for t in _models.values() if t.active]
        attrs = self._module_attr_storages()
        skip = set(attrs)
        for t in others:  # every tenant's tracked tensors in this process, parked or resident
            skip |= t.parker.tracked_keys()
        fsdp = {k: n for k, n in _fsdp_names(_fsdp_modules(self.model)).items() if k not in attrs}
        return name_untracked(self.device, skip - set(fsdp), known=fsdp)  # module attributes: named already

    def _module_attr_storages(self) -> dict[int, tuple[str, int]]:
        """storage key -> (``MODULE.ATTR``, bytes) of plain tensor attributes of the model's modules on its device."""
        out: dict[int, tuple[str, int]] = {}
        for path, module in self.model.named_modules():
            for attr, value in vars(module).items():
                if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
                    continue
                t = local_tensor(value)
                if t.device != self.device or t.is_meta:
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() and storage._cdata not in out:
                    out[storage._cdata] = (f"{path + '.' if path else ''}{attr}", storage.nbytes())
        return out

    def untracked_residue(self) -> dict[str, int]:
        """``untracked:MODULE.ATTR`` -> device bytes of tensors on the model's modules that rota does not park.

        These are plain tensor attributes (not parameters or buffers) such as a cache
        a module keeps on ``self``: they stay on the device across a park.
        """
        tracked = self.parker.tracked_keys()
        return {f"untracked:{name}": n for key, (name, n) in self._module_attr_storages().items()
                if key not in tracked}

    def _park_args(self, plan: ParkPlan | None) -> tuple[list[str], set[str]]:
        """Check that parking is allowed now; the tags to park and to discard under ``plan``."""
        self._check_can_park()
        plan = plan or ParkPlan()
        tags = [t for t in self.tags if plan.wants(t)]
        drop = set(self.discard) | set(plan.discard)
        if plan.mode is ParkMode.DISCARD:
            drop |= set(tags)
        return tags, drop

    def _reshard(self) -> None:
        if not self.parker.parked:
            modules = _fsdp_modules(self.model)
            for m in modules:  # free FSDP2's unsharded all-gather buffers
                m.reshard()
            _drop_fsdp_comm_state(modules)

    def _check_can_park(self) -> None:
        self._check_active()
        if self.gpu.grant is not None:
            raise HoldsTurn(f"cannot park tenant {self.gpu.tenant!r}: it holds group {self.gpu.group!r} "
                            "(release the turn first; rota parks only between turns)",
                            job_id=self.gpu.tenant, group_id=self.gpu.group)
        if self.backward_in_flight:
            raise BackwardInFlight(f"cannot park tenant {self.gpu.tenant!r}: a backward pass through "
                                   f"{type(self.model).__name__} is in flight; park between steps",
                                   job_id=self.gpu.tenant, group_id=self.gpu.group)

    def restore(self, plan: ParkPlan | None = None) -> ParkResult:
        """Bring everything parked back onto the device (discarded tags zero-filled)."""
        self._check_active()
        return self.parker.restore()

    def footprint(self) -> dict[str, int]:
        """Device bytes per tag when resident (also while parked)."""
        return self.parker.footprint()

    def prepare(self, pool_bytes: int | None = None) -> float:
        """Allocate the host pool now (blocking); returns seconds spent. ``track`` starts it in the background."""
        return self.parker.reserve(pool_bytes if pool_bytes is not None else self._pool_estimate())

    def _pool_estimate(self) -> int:
        """Bytes the pool needs at steady state: weights, grads, and optimizer state.

        Optimizer state appears on the first step; for Adam-family optimizers with no
        state yet it is estimated as two copies of the trainable parameters plus a step
        counter each (other optimizers grow the pool once, at the first park after a step).
        """
        fp = dict.fromkeys(TAGS, 0)  # slot sizes as the pool carves them (aligned)
        for s, tag, _ in self.parker.storages().values():
            fp[tag] += align(s.nbytes())
        total = fp["weights"] + fp["optimizer"]
        params = [p for p in self.model.parameters() if p.requires_grad]
        trainable = sum(align(local_tensor(p).untyped_storage().nbytes()) for p in params)
        if "grads" in self.tags and "grads" not in self.discard:
            total += max(fp.get("grads", 0), trainable)
        if ("optimizer" in self.tags and self.optimizer is not None and not self.optimizer.state
                and type(self.optimizer).__name__ in _ADAM_LIKE):
            total += 2 * trainable + len(params) * align(8)  # exp_avg, exp_avg_sq, and a step scalar each
        return total

    # -------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` as CPU tensors, read from the host copy while parked.

        Needs no device and no turn. For FSDP2 each rank gets its *local shards*
        (plain tensors, not ``DTensor``); ``"rota"`` says so, with rank and world size.
        """
        self._check_active()
        with self.parker.lock:
            model_sd = {k: self._host(v) for k, v in self.model.state_dict(keep_vars=True).items()}
            out: dict[str, Any] = {"model": model_sd}
            if self.optimizer is not None:
                out["optimizer"] = self._host_tree(self.optimizer.state_dict())
        sharded = any(getattr(p, "_local_tensor", None) is not None for p in self.model.parameters())
        out["rota"] = {"tenant": self.gpu.tenant, "rank": self.gpu.rank, "world_size": self.gpu.world_size,
                       "local_shards": sharded, "from_parked": self.parked}
        return out

    def save_checkpoint(self, path: str) -> None:
        """``torch.save(self.state_dict(), path)``: a checkpoint written from the host copy."""
        torch.save(self.state_dict(), path)
        log.info("tenant %s rank %d: checkpoint written to %s (parked=%s)", self.gpu.tenant, self.gpu.rank,
                 path, self.parked)

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return self.parker.host_tensor(t)

    def _host_tree(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._host(obj)
        if isinstance(obj, dict):
            return {k: self._host_tree(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self._host_tree(v) for v in obj]
        return obj

    # --------------------------------------------------------------- lifecycle

    def untrack(self) -> None:
        """Stop parking this model: restore it if parked, unregister hooks and plugin."""
        if not self.active:
            return
        if self.parker.parked:
            self.parker.restore()
        for h in self._hooks:
            h.remove()
        if self.gpu.pm.get_plugin(self._plugin_name) is not None:
            self.gpu.pm.unregister(name=self._plugin_name)
        with _lock:
            _models.pop(id(self.model), None)
            for key in [k for k, (_, owner) in _params.items() if owner is self]:
                del _params[key]
            if not any(t.gpu is self.gpu for t in _models.values()):
                _devices.pop(self.gpu, None)
        self.active = False

    def _check_active(self) -> None:
        if not self.active:
            raise InvalidArgument(f"model {type(self.model).__name__} of tenant {self.gpu.tenant!r} was untracked")

    def __repr__(self) -> str:
        return (f"Tracked(tenant={self.gpu.tenant!r}, model={type(self.model).__name__}, device={self.device}, "
                f"tags={self.tags}, discard={sorted(self.discard)}, parked={self.parked})")


def check_tags(gpu: Gpu, tags: Iterable[str], discard: Iterable[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    """Validate ``track``'s tags and discard set (shared with rota_megatron): (tags, discard)."""
    tags = tuple(dict.fromkeys(tags))
    unknown = set(tags) - set(TAGS)
    if unknown or not tags:
        raise TrackingError(f"tags {sorted(unknown) or '()'} not understood; choose from {TAGS}",
                            job_id=gpu.tenant, group_id=gpu.group)
    drop = frozenset(discard)
    if not drop <= set(tags):
        raise TrackingError(f"discard {sorted(drop - set(tags))} names tags that are not tracked {tags}",
                            job_id=gpu.tenant, group_id=gpu.group)
    return tags, drop


def track(gpu: Gpu, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
          tags: Iterable[str] = TAGS, discard: Iterable[str] = (), device: torch.device | str | None = None,
          pool_bytes: int | None = None, release_cached: bool = True, verify: str | None = None,
          deadline_s: float | None = None, recreate: dict[str, Callable[[], None]] | None = None) -> Tracked:
    """Make ``model`` (a module, DDP or FSDP2 model) and ``optimizer`` parkable for tenant ``gpu``.

    :param gpu: the tenant, from :func:`rota.connect`.
    :param model: the module whose parameters, buffers and grads are parked.
    :param optimizer: its optimizer; its state is parked under ``"optimizer"``.
    :param tags: which of ``weights``, ``grads``, ``optimizer`` to park.
    :param discard: tags freed without copying (e.g. ``("grads",)``); restored zero-filled.
    :param device: the tenant's device; default: the device of the model's first
        parameter. Every tracked model of one tenant must be on the same device.
    :param pool_bytes: host pool size; default: an estimate of weights + grads +
        optimizer state. The pool is allocated in the background from here on.
    :param release_cached: on CUDA, hand freed memory back to the driver after a park.
    :param verify: ``off``, ``sample`` or ``full`` checks of restored state (default ``ROTA_VERIFY`` or sample).
    :param deadline_s: seconds a park or restore may take before it is rolled back
        (default ``ROTA_SWITCH_DEADLINE_S``; 0 = none).
    :param recreate: tag -> callback that rebuilds a *discarded* ``weights`` or
        ``optimizer`` tag after a restore (e.g. reload weights); without one such a
        restore fails naming the tag.
    :returns: the :class:`Tracked` handle (``untrack()``, ``state_dict()``, ``footprint()``).
    :raises TrackingError: a bad tag, a device mismatch, or a model tracked twice.
    """
    tags, drop = check_tags(gpu, tags, discard)
    for tag in sorted(drop & {"weights", "optimizer"}):
        if tag not in (recreate or {}):
            log.warning("tenant %s: %s is discarded at park and has no recreate= callback: its restores will fail",
                        gpu.tenant, tag)
    bad = set(recreate or {}) - set(TAGS)
    if bad or any(not callable(f) for f in (recreate or {}).values()):
        raise TrackingError(f"recreate= must map tags of {TAGS} to callables; got {sorted(recreate or {})}",
                            job_id=gpu.tenant, group_id=gpu.group)
    named = list(itertools.chain(model.named_parameters(), model.named_buffers()))
    if device is None:
        device = getattr(gpu, "device", None) or _devices.get(gpu)
    if device is None:
        if not named:
            raise TrackingError(f"model {type(model).__name__} has no parameters or buffers to infer a device "
                                "from; pass device=", job_id=gpu.tenant, group_id=gpu.group)
        device = local_tensor(named[0][1]).device
    device = _norm_device(device)
    for name, t in named:
        where = local_tensor(t).device
        if where != device:
            raise DeviceMismatch(f"cannot track {type(model).__name__} for tenant {gpu.tenant!r}: {name!r} is on "
                                 f"{where} but the tenant's device is {device}; move the model with "
                                 f".to({str(device)!r}) or pass device=", job_id=gpu.tenant, group_id=gpu.group)
    with _lock:
        group_device = _devices.get(gpu)
        if group_device is not None and group_device != device:
            raise DeviceMismatch(f"tenant {gpu.tenant!r} of group {gpu.group!r} already parks tensors on "
                                 f"{group_device}; a model on {device} cannot join it (one device per tenant)",
                                 job_id=gpu.tenant, group_id=gpu.group)
        other = _models.get(id(model))
        if other is not None and other.active:
            raise AlreadyTracked(f"{type(model).__name__} is already tracked for tenant {other.gpu.tenant!r}; "
                                 "call untrack() on the first Tracked before tracking it again",
                                 job_id=gpu.tenant, group_id=gpu.group)
        for name, p in model.named_parameters():
            ref, owner = _params.get(id(p), (None, None))
            if owner is not None and owner.active and ref is not None and ref() is p:
                raise AlreadyTracked(f"parameter {name!r} of {type(model).__name__} is already tracked through "
                                     f"{type(owner.model).__name__} of tenant {owner.gpu.tenant!r} (a parent or "
                                     "child module?); track each parameter once", job_id=gpu.tenant,
                                     group_id=gpu.group)
        tracked = Tracked(gpu, model, optimizer, tags, drop, device, release_cached, verify, deadline_s, recreate)
        _models[id(model)] = tracked
        for p in model.parameters():
            _params[id(p)] = (weakref.ref(p), tracked)
        _devices[gpu] = device
    gpu.pm.register(tracked._plugin, name=tracked._plugin_name)
    nbytes = pool_bytes if pool_bytes is not None else tracked._pool_estimate()
    tracked.parker.reserve(nbytes, background=True)
    log.info("tenant %s rank %d: tracking %s on %s (tags %s, discard %s); host pool %.3f GB in the background",
             gpu.tenant, gpu.rank, type(model).__name__, device, tags, sorted(drop), nbytes / 1e9)
    return tracked
