"""``Tracked``: the base every torch trainer adapter subclasses; a subclass says *which* tensors, this does the rest.

Who uses it: ``rota_fsdp.track`` and ``rota_megatron.track`` each construct their
subclass once per tracked model; a new adapter is one more subclass (see the package
README). Constructing a ``Tracked``:

1. checks the tags, the discard set and ``recreate=`` (:func:`check_tags`);
2. finds the tenant's device (``device=``, the tenant's, or that of the first tensor of
   :meth:`Tracked.device_tensors`) and checks every one of those tensors is on it;
3. refuses a model or parameter another active handle tracks, and a second device for
   one tenant: one registry per process, shared by every adapter, so a parameter
   tracked through ``rota_fsdp`` is refused by ``rota_megatron``;
4. builds a :class:`~rota_torch.TensorParker` fed on every park by :meth:`Tracked.weights`,
   :meth:`Tracked.optimizer_state` and :meth:`Tracked.grads` (in that order: the first
   tag owns storages they share);
5. guards :meth:`Tracked.forward_modules`: no forward while parked, backward passes counted
   so no park runs during one;
6. registers its ``rota_park``/``rota_restore``/``rota_footprint``/``rota_turn_ended``
   hooks on ``gpu.pm`` (answering only for that ``gpu``: several tenants may share one
   process) and starts the host pool (:meth:`Tracked.pool_estimate` bytes) in the background.

Every park reports its residue: tracked tags still on the device, ``untracked:MODULE.ATTR``
for plain tensor attributes of the model's modules, and on CUDA, when the allocator holds
much more than that, every live tensor on the device no handle parks, named by who holds
it; NVML's bytes outside torch's allocator are reported as ``process:outside_allocator``
(and their growth since ``track`` as ``process:outside_allocator_growth``) and count
against no limit. These process-wide readings come from the last of a tenant's tracked models
to park (the hooks park one model at a time; before that the process still holds the others),
and memory this process's allocator does not own (a CUDA IPC tensor of another process) is
never its residue. Restores are verified (``verify=``), bounded (``deadline_s=``) and
refused without room. A discarded ``weights`` or ``optimizer`` tag must be re-created by
a ``recreate={"weights": fn}`` callback, or the restore fails naming it; discarded
``grads`` come back zero-filled.
"""

from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch

from rota import Gpu, ParkMode, ParkPlan, ParkResult, hookimpl
from rota.errors import InvalidArgument
from rota.residue import attributed_residue, residue_max_bytes
from rota_torch._move import move_resident, rehome_parked
from rota_torch._overlap import overlap
from rota_torch._parker import TensorParker, local_tensor
from rota_torch._pool import align
from rota_torch._residue import (
    collect_if_over,
    fragmentation,
    give_back_workspaces,
    name_untracked,
    outside_allocator_bytes,
)
from rota_torch._working import counts_cache
from rota_torch.errors import AlreadyTracked, BackwardInFlight, DeviceMismatch, HoldsTurn, TrackingError

__all__ = ["ADAM_LIKE", "IDLE_CACHE_SHARE", "TAGS", "Tracked", "check_tags", "switch", "tracked_models"]

log = logging.getLogger(__name__)

TAGS = ("weights", "grads", "optimizer")
#: An idle resident keeps at most this share of the device in torch's cache of freed blocks (the step's
#: temporaries, e.g. AdamW's foreach buffers): more goes back to the driver when its turn ends, for the next holder,
#: unless its footprint counts that cache (a :class:`~rota_torch.WorkingSet`): then the capacity holds room for it.
IDLE_CACHE_SHARE = 0.05
NAME_UNEXPLAINED_ABOVE = 128 << 20  # allocator bytes beyond the named residue that make a park name every tensor
#: Optimizers whose state (two moments and a step per parameter) :meth:`Tracked.pool_estimate` foresees.
ADAM_LIKE = ("Adam", "AdamW", "Adamax", "NAdam", "RAdam")

_lock = threading.Lock()  # guards the three tables below
_models: dict[int, Tracked] = {}  # id(model) -> Tracked; the Tracked keeps the model alive until untrack()
_params: dict[int, tuple[weakref.ref[torch.Tensor], Tracked]] = {}  # id(param) -> (param, owner)
_devices: weakref.WeakKeyDictionary[Gpu, torch.device] = weakref.WeakKeyDictionary()


def tracked_models() -> list[Tracked]:
    """Every active handle in this process, of every adapter (e.g. for tests to untrack what they tracked)."""
    with _lock:
        return [t for t in _models.values() if t.active]


def check_tags(gpu: Gpu, tags: Iterable[str], discard: Iterable[str]) -> tuple[tuple[str, ...], frozenset[str]]:
    """``track``'s tags (de-duplicated, each one of :data:`TAGS`) and discard set (tracked tags only).

    :raises TrackingError: an unknown or empty tag list, or a discarded tag that is not tracked.
    """
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


def _check_recreate(gpu: Gpu, discard: frozenset[str], recreate: dict[str, Callable[[], None]] | None
                    ) -> dict[str, Callable[[], None]]:
    recreate = recreate or {}
    if set(recreate) - set(TAGS) or any(not callable(f) for f in recreate.values()):
        raise TrackingError(f"recreate= must map tags of {TAGS} to callables; got {sorted(recreate)}",
                            job_id=gpu.tenant, group_id=gpu.group)
    for tag in sorted(discard & {"weights", "optimizer"}):
        if tag not in recreate:
            log.warning("tenant %s: %s is discarded at park and has no recreate= callback: its restores will fail",
                        gpu.tenant, tag)
    return recreate


def _norm_device(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors in a forward output: a tensor, or lists/tuples/dicts of them."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors_in(x)


class _TenantPlugin:
    """The hook implementations of one tracked model, answering only for its own Gpu."""

    def __init__(self, tracked: Tracked) -> None:
        self.tracked = tracked

    @hookimpl
    def rota_park(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        return self.tracked.park(plan) if tenant is self.tracked.gpu else None

    @hookimpl
    def rota_restore(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        return self.tracked.restore(plan) if tenant is self.tracked.gpu else None

    @hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        return self.tracked.footprint() if tenant is self.tracked.gpu else None

    @hookimpl
    def rota_turn_ended(self, tenant: Gpu, grant: object, seconds: float) -> None:
        if tenant is self.tracked.gpu:
            self.tracked.trim_cache()


class Tracked:
    """A model (and optimizer) whose device state rota parks between the tenant's turns.

    Constructing one tracks the model (see the module docs); adapters' ``track()``
    functions construct their subclass. The orchestrator drives :meth:`park` and
    :meth:`restore` through the Gpu's hooks; call them directly only in benchmarks and
    tests (a direct park leaves ``gpu.parked`` unset, so prefer ``gpu.park()``).

    The defaults of the overridable methods suit a plain ``nn.Module`` and a torch
    optimizer; a subclass overrides what its framework keeps elsewhere.

    :param gpu: the tenant, from :func:`rota.connect`.
    :param model: the module whose parameters, buffers and grads are parked.
    :param optimizer: its optimizer; its state is parked under ``"optimizer"``.
    :param tags: which of ``weights``, ``grads``, ``optimizer`` to park.
    :param discard: tags freed without copying (e.g. ``("grads",)``); grads come back zero-filled.
    :param device: the tenant's device; default: the tenant's, else that of the first
        tensor of :meth:`device_tensors`. Every tracked model of one tenant must be on it.
    :param pool_bytes: host pool size; default :meth:`pool_estimate`. Allocated in the background.
    :param release_cached: on CUDA, hand freed memory back to the driver after a park.
    :param verify: ``off``, ``sample`` or ``full`` checks of restored state (default ``ROTA_VERIFY`` or sample).
    :param deadline_s: seconds a park or restore may take before it is rolled back
        (default ``ROTA_SWITCH_DEADLINE_S``; 0 = none).
    :param recreate: tag -> callback that rebuilds a *discarded* ``weights`` or
        ``optimizer`` tag after a restore (e.g. reload weights); without one such a
        restore fails naming the tag.
    :raises TrackingError: a bad tag or recreate=; :class:`DeviceMismatch` for a tensor off
        the tenant's device; :class:`AlreadyTracked` for a model or parameter tracked twice.
    """

    def __init__(self, gpu: Gpu, model: torch.nn.Module, optimizer: Any = None, *, tags: Iterable[str] = TAGS,
                 discard: Iterable[str] = (), device: torch.device | str | None = None, pool_bytes: int | None = None,
                 release_cached: bool = True, verify: str | None = None, deadline_s: float | None = None,
                 recreate: dict[str, Callable[[], None]] | None = None) -> None:
        self.gpu, self.model, self.optimizer = gpu, model, optimizer
        self.active = False
        self.tags, self.discard = check_tags(gpu, tags, discard)
        recreate = _check_recreate(gpu, self.discard, recreate)
        self.device = self._find_device(device)
        with _lock:
            self._check_not_tracked()
            self.parker = TensorParker(self.device, release_cached=release_cached,
                                       name=f"{gpu.tenant}/{self.describe()}", verify=verify, deadline_s=deadline_s)
            sources = {"weights": self.weights, "optimizer": self.optimizer_state, "grads": self.grads}
            for tag in sources:  # this order sets ownership of shared storages
                if tag in self.tags:
                    self.parker.add(tag, sources[tag],
                                    on_discard=recreate.get(tag, "zeros" if tag == "grads" else "error"))
            self._backward_depth = 0
            self._hooks = [h for m in self.forward_modules() for h in (
                m.register_forward_pre_hook(self._before_forward), m.register_forward_hook(self._after_forward))]
            # Outside-allocator bytes now, before this job's collectives ran: their growth is NCCL's.
            self._outside_at_track = outside_allocator_bytes(self.device) if self.device.type == "cuda" else None
            self.active = True
            _models[id(model)] = self
            for p in model.parameters():
                _params[id(p)] = (weakref.ref(p), self)
            _devices[gpu] = self.device
        self._plugin = _TenantPlugin(self)
        self._plugin_name = f"{type(self).__module__.split('.')[0]}:{gpu.tenant}:{gpu.rank}:{id(self):x}"
        gpu.pm.register(self._plugin, name=self._plugin_name)
        nbytes = pool_bytes if pool_bytes is not None else self.pool_estimate()
        self.parker.reserve(nbytes, background=True)
        log.info("tenant %s rank %d: tracking %s on %s (tags %s, discard %s); host pool %.3f GB in the background",
                 gpu.tenant, gpu.rank, self.describe(), self.device, self.tags, sorted(self.discard), nbytes / 1e9)

    # ------------------------------------------------- what a subclass overrides

    def describe(self) -> str:
        """A short name of what is tracked, for messages and logs (default: the model's class name)."""
        return type(self.model).__name__

    def device_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs checked at track time to be on the tenant's device (default: parameters, buffers)."""
        return itertools.chain(self.model.named_parameters(), self.model.named_buffers())

    def forward_modules(self) -> Sequence[torch.nn.Module]:
        """The modules whose forward is guarded (refused while parked; backward counted). Default: the model."""
        return (self.model,)

    def weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs parked under ``weights``, read on every park. Default: parameters and buffers."""
        return itertools.chain(self.model.named_parameters(), self.model.named_buffers())

    def grads(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs parked under ``grads``. Default: every ``param.grad`` present at park time."""
        return ((n, p.grad) for n, p in self.model.named_parameters() if p.grad is not None)

    def optimizer_state(self) -> Iterable[tuple[str, torch.Tensor]]:
        """(name, tensor) pairs parked under ``optimizer``, re-read on every park (optimizers create state lazily).

        Default: every tensor in a torch optimizer's ``state``.
        """
        if self.optimizer is None:
            return ()
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        out = []
        for p, state in list(self.optimizer.state.items()):
            for key, value in list(state.items()):
                if isinstance(value, torch.Tensor):
                    out.append((f"state.{index.get(id(p), '?')}.{key}", value))
        return out

    def pool_estimate(self) -> int:
        """Bytes the host pool needs at steady state: weights, grads, and optimizer state.

        Default: what is tracked now, plus grads of trainable parameters that have none
        yet, plus (for an :data:`ADAM_LIKE` optimizer with no state yet) two copies of
        the trainable parameters and a step counter each; other optimizers grow the
        pool once, at the first park after a step.
        """
        fp = dict.fromkeys(TAGS, 0)  # slot sizes as the pool carves them (aligned)
        for s, tag, _ in self.parker.storages().values():
            fp[tag] += align(s.nbytes())
        total = fp["weights"] + fp["optimizer"]
        params = [p for p in self.model.parameters() if p.requires_grad]
        trainable = sum(align(local_tensor(p).untyped_storage().nbytes()) for p in params)
        if "grads" in self.tags and "grads" not in self.discard:
            total += max(fp["grads"], trainable)
        if ("optimizer" in self.tags and isinstance(self.optimizer, torch.optim.Optimizer)
                and not self.optimizer.state and type(self.optimizer).__name__ in ADAM_LIKE):
            total += 2 * trainable + len(params) * align(8)  # exp_avg, exp_avg_sq, and a step scalar each
        return total

    def before_park(self) -> None:
        """Called before a park of a resident model: free device buffers the framework rebuilds. Default: none."""

    def framework_buffers(self) -> dict[int, str]:
        """storage key -> name of device buffers the framework holds and rota does not park, for residue reports."""
        return {}

    # ------------------------------------------------------------------ guards

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
        tags, drop = self._prepare_park(plan)
        result = self.parker.park(tags, drop)
        result.residue.update(self.untracked_residue())
        if self._others_resident():  # read the process once, after the tenant's last tracked model is parked
            for key in [k for k in result.residue if k.startswith("process:")]:
                del result.residue[key]
        elif self.device.type == "cuda":  # read here too: a park of a parked model (a re-check) moves nothing
            named = sum(attributed_residue(result.residue).values())
            before = int(torch.cuda.memory_allocated(self.device))
            if collect_if_over(before, named, residue_max_bytes()):
                log.info("tenant %s: the park collected garbage (gc.collect()): %d MiB freed on %s", self.gpu.tenant,
                         (before - int(torch.cuda.memory_allocated(self.device))) >> 20, self.device)
            # cuBLAS's workspaces go only when no tracked model of this process is on the device: another tenant
            # sharing the process (the demo's in-process mode) may be mid-matmul with them
            if self.parker.release_cached and all(t.parked for t in tracked_models()):
                give_back_workspaces(self.device)
            result.residue.update(fragmentation(self.device))
            result.residue["process:allocated"] = int(torch.cuda.memory_allocated(self.device))
            result.residue["process:reserved"] = int(torch.cuda.memory_reserved(self.device))
            result.residue.update(self._unexplained_residue(result.residue))
            outside = outside_allocator_bytes(self.device)
            if outside is not None:
                result.residue["process:outside_allocator"] = outside
                if self._outside_at_track is not None:
                    result.residue["process:outside_allocator_growth"] = max(0, outside - self._outside_at_track)
        return result

    def _others_resident(self) -> bool:
        """Whether another tracked model of this tenant is still on the device: the hooks park one model at a
        time, so until the last one has parked, the process's allocator (and any tensor walk) still holds its
        state. Process-wide readings are then left to that last park."""
        return any(t is not self and t.gpu is self.gpu and not t.parked for t in tracked_models())

    def restore(self, plan: ParkPlan | None = None) -> ParkResult:
        """Bring everything parked back onto the device (discarded tags zero-filled or re-created).

        With ``plan.device`` another device than the model's (a turn granted on another GPU of
        the group), the state goes there: restored there if parked, moved device to device
        if resident (:mod:`rota_torch._move`). A restore that fails there leaves it parked.
        """
        self._check_active()
        target = self._granted_device(plan)
        if target is None or target == self.device:
            return self.parker.restore()
        source = self.device
        if self.parker.parked:
            rehome_parked(self.parker, target)
            self._moved(source, target)
            return self.parker.restore()
        result = move_resident(self.parker, target)
        self._moved(source, target)
        log.info("tenant %s: %s moved %s -> %s (%.3f GB device to device in %.3f s)", self.gpu.tenant,
                 self.describe(), source, target, result.bytes_moved / 1e9, result.seconds)
        return result

    def _granted_device(self, plan: ParkPlan | None) -> torch.device | None:
        """``plan.device`` as a torch device (None when the plan names none); fake and unknown ones refused."""
        name = getattr(plan, "device", "") if plan is not None else ""
        if not name:
            return None
        if not name.startswith("cuda:") or self.device.type != "cuda":
            raise DeviceMismatch(f"turn of tenant {self.gpu.tenant!r} granted on {name}, but {self.describe()} is on "
                                 f"{self.device}: rota_torch moves state only between CUDA devices; name cuda:N "
                                 "devices in ROTA_DEVICES (fake:N is for placement tests)",
                                 job_id=self.gpu.tenant, group_id=self.gpu.group)
        target = torch.device(name)
        if target.index >= torch.cuda.device_count():
            raise DeviceMismatch(f"turn of tenant {self.gpu.tenant!r} granted on {name}, but this process sees "
                                 f"{torch.cuda.device_count()} CUDA device(s); make ROTA_DEVICES match "
                                 "CUDA_VISIBLE_DEVICES", job_id=self.gpu.tenant, group_id=self.gpu.group)
        return target

    def _moved(self, source: torch.device, target: torch.device) -> None:
        with _lock:
            self.device = target
            _devices[self.gpu] = target
        if target.type == "cuda":  # the new device's own baseline, for NCCL-growth readings
            self._outside_at_track = outside_allocator_bytes(target)

    def footprint(self) -> dict[str, int]:
        """Device bytes per tag when resident (also while parked)."""
        return self.parker.footprint()

    def prepare(self, pool_bytes: int | None = None) -> float:
        """Allocate the host pool now (blocking); returns seconds spent. Construction starts it in the background."""
        return self.parker.reserve(pool_bytes if pool_bytes is not None else self.pool_estimate())

    def trim_cache(self) -> None:
        """After a turn: give torch's cached free blocks back to the driver if they exceed :data:`IDLE_CACHE_SHARE`.

        The tenant stays resident (nothing is parked); the next holder gets room for its
        own temporaries. Small caches are kept: reallocating them every turn costs time. So is
        a cache the tenant's footprint counts (:func:`~rota_torch.counts_cache`): the orchestrator
        keeps room for it whether it is held or not, so giving it back makes no room for anyone and
        the next turn would map it again (an SFT step of the demo split into four turns paid that
        four times a step).
        """
        if self.device.type != "cuda" or not self.parker.release_cached or counts_cache(self.gpu):
            return
        cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        if cached > IDLE_CACHE_SHARE * torch.cuda.get_device_properties(self.device).total_memory:
            torch.cuda.empty_cache()

    def untracked_residue(self) -> dict[str, int]:
        """``untracked:MODULE.ATTR`` -> device bytes of tensors on the model's modules that rota does not park.

        These are plain tensor attributes (not parameters or buffers) such as a cache
        a module keeps on ``self``: they stay on the device across a park.
        """
        tracked = self.parker.tracked_keys()
        return {f"untracked:{name}": n for key, (name, n) in self._module_attr_storages().items()
                if key not in tracked}

    def _prepare_park(self, plan: ParkPlan | None) -> tuple[list[str], set[str]]:
        """Check that parking is allowed now and run :meth:`before_park`; the tags to park and to discard."""
        self._check_active()
        if self.gpu.grant is not None:
            raise HoldsTurn(f"cannot park tenant {self.gpu.tenant!r}: it holds group {self.gpu.group!r} "
                            "(release the turn first; rota parks only between turns)",
                            job_id=self.gpu.tenant, group_id=self.gpu.group)
        if self.backward_in_flight:
            raise BackwardInFlight(f"cannot park tenant {self.gpu.tenant!r}: a backward pass through "
                                   f"{self.describe()} is in flight; park between steps",
                                   job_id=self.gpu.tenant, group_id=self.gpu.group)
        plan = plan or ParkPlan()
        tags = [t for t in self.tags if plan.wants(t)]
        drop = set(self.discard) | set(plan.discard)
        if plan.mode is ParkMode.DISCARD:
            drop |= set(tags)
        if not self.parker.parked:
            self.before_park()
        return tags, drop

    def _unexplained_residue(self, residue: dict[str, int]) -> dict[str, int]:
        """Name every untracked live tensor when the allocator holds far more than the residue named so far."""
        named = sum(attributed_residue(residue).values())
        if residue.get("process:allocated", 0) - named <= NAME_UNEXPLAINED_ABOVE:
            return {}
        attrs = self._module_attr_storages()
        skip = set(attrs)
        for t in tracked_models():  # every tenant's tracked tensors in this process, parked or resident
            skip |= t.parker.tracked_keys()
        known = {k: n for k, n in self.framework_buffers().items() if k not in attrs}
        return name_untracked(self.device, skip - set(known), known=known)  # module attributes: named already

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

    # -------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` as CPU tensors, read from the host copy while parked.

        Needs no device and no turn. For FSDP2 each rank gets its *local shards*
        (plain tensors, not ``DTensor``); ``"rota"`` says so, with rank and world size.
        """
        self._check_active()
        with self.parker.lock:
            out: dict[str, Any] = {"model": {k: self.parker.host_tensor(v)
                                             for k, v in self.model.state_dict(keep_vars=True).items()}}
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

    def _host_tree(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            return self.parker.host_tensor(obj)
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
            raise InvalidArgument(f"model {self.describe()} of tenant {self.gpu.tenant!r} was untracked")

    def _find_device(self, device: torch.device | str | None) -> torch.device:
        """``device``, the tenant's, or the first tensor's; every tensor of :meth:`device_tensors` must be on it."""
        named = list(self.device_tensors())
        if device is None:
            device = getattr(self.gpu, "device", None) or _devices.get(self.gpu)
        if isinstance(device, str) and device.startswith("fake:"):
            raise DeviceMismatch(f"tenant {self.gpu.tenant!r} names fake device {device}: rota_torch parks tensors "
                                 "of real devices; name cuda:N in ROTA_DEVICES (fake:N is for placement tests)",
                                 job_id=self.gpu.tenant, group_id=self.gpu.group)
        if device is None:
            if not named:
                raise TrackingError(f"{self.describe()} has no parameters or buffers to infer a device from; "
                                    "pass device=", job_id=self.gpu.tenant, group_id=self.gpu.group)
            device = local_tensor(named[0][1]).device
        device = _norm_device(device)
        for name, t in named:
            where = local_tensor(t).device
            if where != device:
                raise DeviceMismatch(f"cannot track {self.describe()} for tenant {self.gpu.tenant!r}: {name!r} is on "
                                     f"{where} but the tenant's device is {device}; move the model with "
                                     f".to({str(device)!r}) or pass device=",
                                     job_id=self.gpu.tenant, group_id=self.gpu.group)
        return device

    def _check_not_tracked(self) -> None:
        """Under ``_lock``: one device per tenant, and the model and each parameter tracked once."""
        gpu = self.gpu
        group_device = _devices.get(gpu)
        if group_device is not None and group_device != self.device:
            raise DeviceMismatch(f"tenant {gpu.tenant!r} of group {gpu.group!r} already parks tensors on "
                                 f"{group_device}; a model on {self.device} cannot join it (one device per tenant)",
                                 job_id=gpu.tenant, group_id=gpu.group)
        other = _models.get(id(self.model))
        if other is not None and other.active:
            raise AlreadyTracked(f"{self.describe()} is already tracked for tenant {other.gpu.tenant!r}; "
                                 "call untrack() on the first handle before tracking it again",
                                 job_id=gpu.tenant, group_id=gpu.group)
        for name, p in self.model.named_parameters():
            ref, owner = _params.get(id(p), (None, None))
            if owner is not None and owner.active and ref is not None and ref() is p:
                raise AlreadyTracked(f"parameter {name!r} of {self.describe()} is already tracked through "
                                     f"{owner.describe()} of tenant {owner.gpu.tenant!r} (a parent or child "
                                     "module?); track each parameter once", job_id=gpu.tenant, group_id=gpu.group)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(tenant={self.gpu.tenant!r}, model={self.describe()}, device={self.device}, "
                f"tags={self.tags}, discard={sorted(self.discard)}, parked={self.parked})")


def switch(park: Tracked | Sequence[Tracked] = (), restore: Tracked | Sequence[Tracked] = ()
           ) -> tuple[ParkResult, ParkResult]:
    """Park ``park`` while restoring ``restore`` in this process, overlapped on two streams.

    For tenants that share one process (benchmarks, the demo's in-process mode);
    tenants in separate processes overlap on their own. Both sides must be between
    turns; the device needs room for both while the switch runs. Returns
    (park result, restore result), each carrying the wall time of the whole switch.
    """
    outs = [park] if isinstance(park, Tracked) else list(park)
    ins = [restore] if isinstance(restore, Tracked) else list(restore)
    return overlap([(t.parker, *t._prepare_park(None)) for t in outs], [t.parker for t in ins])
