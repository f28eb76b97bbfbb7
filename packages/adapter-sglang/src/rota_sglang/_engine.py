"""``track(gpu, engine)``: park an in-process SGLang ``Engine`` by releasing its memory occupation.

Who calls it: an RL script that builds ``sglang.Engine(..., enable_memory_saver=True)``::

    gpu = rota.connect()
    tracked = rota_sglang.track(gpu, engine)
    with gpu.turn():                                      # resume_memory_occupation
        tracked.update_weights(trainer_model.named_parameters())
        outs = engine.generate(prompts, sampling_params)

Park: ``engine.release_memory_occupation(tags=...)`` (tags ``weights``, ``kv_cache``,
``cuda_graph``; all when the plan names none), then this process's idle CUDA cache, where
pushed weights were staged (``rota_serving.release_idle_cache``). Restore:
``engine.resume_memory_occupation(tags=...)``. The KV cache is always dropped; the
weights are kept on host only when the engine runs with
``enable_weights_cpu_backup=True`` — otherwise they come back with undefined contents
and must be pushed again (:meth:`TrackedEngine.update_weights`), which ``dropped`` and
``weights_stale`` record. The engine is duck-typed; SGLang is imported only for the
version check.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rota import Gpu, ParkPlan, ParkResult, hookimpl
from rota.errors import InvalidArgument
from rota_serving import SGLANG, check_fixed_device, check_tags, device_share_bytes, release_idle_cache
from rota_sglang._compat import require_sglang

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache", "cuda_graph")


class TrackingError(InvalidArgument):
    """``track`` got an engine it cannot park, or a call came at the wrong time."""


_lock = threading.Lock()
_tracked: dict[int, TrackedEngine] = {}


class TrackedEngine:
    """One tracked SGLang ``Engine``; its hooks answer only for ``gpu``."""

    def __init__(self, gpu: Gpu, engine: Any, tags: tuple[str, ...], weights_backup: bool,
                 footprint_bytes: int = 0) -> None:
        self.gpu, self.engine, self.tags, self.weights_backup = gpu, engine, tags, weights_backup
        self.footprint_bytes = footprint_bytes  # device bytes while resident; 0: unknown
        self.released: tuple[str, ...] = ()
        self.dropped: tuple[str, ...] = ()
        self.weights_stale = False
        self.history: list[tuple[str, tuple[str, ...] | int]] = []
        self._name = f"rota-sglang-{gpu.tenant}-{id(engine):x}"

    @hookimpl
    def rota_park(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu or self.released:
            return None
        tags = tuple(t for t in TAGS if t in plan.tags) if plan.tags else self.tags
        t0 = time.perf_counter()
        self.engine.release_memory_occupation(tags=list(tags) if tags else None)
        release_idle_cache()  # weights pushed from this process (update_weights) were staged in its own cache
        self.released = tags or TAGS
        dropped = {"kv_cache", "cuda_graph"} & set(self.released)
        if "weights" in self.released and not self.weights_backup:
            dropped.add("weights")
            self.weights_stale = True
        self.dropped = tuple(t for t in TAGS if t in dropped)
        self.history.append(("release", self.released))
        log.info("SGLang of %s released %s (dropped %s)", tenant.tenant, ",".join(self.released),
                 ",".join(self.dropped) or "nothing")
        return ParkResult(seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_restore(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu or not self.released:
            return None
        t0 = time.perf_counter()
        tags = None if set(self.released) == set(TAGS) and not self.tags else list(self.released)
        self.engine.resume_memory_occupation(tags=tags)
        self.history.append(("resume", tuple(tags or TAGS)))
        self.released = ()
        return ParkResult(seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        """While resident, what the engine holds (``footprint_bytes``: its static share of the device unless given),
        so that a capacity counts it; 1 byte where unknown (nonzero: the orchestrator still parks it when it needs
        room); 0 released."""
        if tenant is not self.gpu:
            return None
        return {"engine": 0 if self.released else (self.footprint_bytes or 1)}

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Push ``(name, tensor)`` pairs through ``engine.update_weights_from_tensor`` (inside a turn)."""
        if self.released:
            raise TrackingError(f"the SGLang engine of job {self.gpu.tenant!r} is released; push weights inside "
                                "`with gpu.turn():`", job_id=self.gpu.tenant, group_id=self.gpu.group)
        named = list(named_tensors)
        if not named or not all(isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str) for p in named):
            raise TrackingError("update_weights needs a non-empty list of (name, tensor) pairs, e.g. "
                                "model.named_parameters()", job_id=self.gpu.tenant)
        self.engine.update_weights_from_tensor(named_tensors=named)
        self.weights_stale = False
        self.history.append(("update_weights", len(named)))
        return len(named)

    def untrack(self) -> None:
        if self.released:
            self.rota_restore(self.gpu, ParkPlan())
        self.gpu.pm.unregister(name=self._name)
        with _lock:
            _tracked.pop(id(self.engine), None)


def track(gpu: Gpu, engine: Any, *, tags: Sequence[str] = (), weights_backup: bool | None = None,
          footprint_bytes: int | None = None, check_version: bool = True) -> TrackedEngine:
    """Let rota park ``engine`` (``sglang.Engine(..., enable_memory_saver=True)``) between turns.

    :param tags: what to release on park (default: everything).
    :param weights_backup: whether the engine keeps weights on host
        (``enable_weights_cpu_backup``); read from the engine's server args when None.
    :param footprint_bytes: device bytes the engine holds while resident, reported to rota so that a ``--capacity``
        counts it. None: its ``mem_fraction_static`` share of this process's device when this process has started
        CUDA (weights and KV pool; CUDA graphs and activations come on top), else unknown (reported as 1 byte).
    :raises rota_sglang.UnsupportedVersion: SGLang missing or outside the targeted versions.
    :raises rota.errors.ConfigError: ``gpu`` names several devices (an engine cannot move between them).
    """
    if check_version:
        require_sglang()
    check_fixed_device(gpu.devices, f"the sglang.Engine of tenant {gpu.tenant!r}")
    tags = check_tags(SGLANG, tags, "track(tags=)")
    for attr in ("release_memory_occupation", "resume_memory_occupation", "update_weights_from_tensor"):
        if not callable(getattr(engine, attr, None)):
            raise TrackingError(f"{type(engine).__name__} has no {attr}(); pass an sglang.Engine (SGLang >= 0.4.6)",
                                job_id=gpu.tenant, group_id=gpu.group)
    args = getattr(engine, "server_args", None)
    if args is not None and getattr(args, "enable_memory_saver", True) is False:
        raise TrackingError("this Engine was built without the memory saver; create it with "
                            "Engine(..., enable_memory_saver=True)", job_id=gpu.tenant, group_id=gpu.group)
    if weights_backup is None:
        weights_backup = bool(getattr(args, "enable_weights_cpu_backup", False))
    if footprint_bytes is None:
        share = getattr(args, "mem_fraction_static", None)
        footprint_bytes = device_share_bytes(share if isinstance(share, float) else None)
    elif isinstance(footprint_bytes, bool) or not isinstance(footprint_bytes, int) or footprint_bytes < 0:
        raise TrackingError(f"footprint_bytes={footprint_bytes!r} must be a whole number of bytes >= 0 (0: unknown)",
                            job_id=gpu.tenant, group_id=gpu.group)
    with _lock:
        if id(engine) in _tracked:
            raise TrackingError(f"this Engine is already tracked by job {_tracked[id(engine)].gpu.tenant!r}",
                                job_id=gpu.tenant)
        tracked = _tracked[id(engine)] = TrackedEngine(gpu, engine, tags, weights_backup, footprint_bytes)
    gpu.pm.register(tracked, name=tracked._name)
    return tracked


__all__ = ["TAGS", "TrackedEngine", "TrackingError", "track"]
