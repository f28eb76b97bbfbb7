"""``track(gpu, llm)``: park an in-process vLLM ``LLM`` with its own sleep mode.

Who calls it: an RL or batch-inference script that builds ``vllm.LLM(...,
enable_sleep_mode=True)`` and shares the GPU through rota::

    gpu = rota.connect()
    engine = rota_vllm.track(gpu, llm)                 # mode from the park plan
    with gpu.turn():                                   # wakes the engine if parked
        engine.update_weights(trainer_state.items())   # optional: RL weight sync
        outs = llm.generate(prompts, params)

Park (``rota_park``) for an OFFLOAD plan (weights kept, KV cache dropped): with
``backup="rota"`` (default) each worker copies its parameters into rota's pinned host
pool (:mod:`rota_vllm._pinned`) and the engine sleeps at level 2; with ``backup="vllm"``
it sleeps at level 1 (vLLM's own host backup, about twice as slow on an H200). A
DISCARD plan sleeps at level 2 and keeps nothing: the weights must be pushed again with
:meth:`TrackedLLM.update_weights` after the wake, which is what an RL loop does anyway.
``dropped`` records what the last park lost.

Restore (``rota_restore``): ``llm.wake_up(tags=...)``; after a level-2 park the
weights come back first, alone (then rota's copy of them, or a weight push), before the
KV cache returns (vLLM's documented order); rota's copy runs while the KV cache is woken.

The ``LLM`` is duck-typed (``sleep``, ``wake_up``, ``collective_rpc``): vLLM itself is
imported only for the version check, so tests use a small fake.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from rota import Gpu, ParkMode, ParkPlan, ParkResult, hookimpl
from rota.errors import InvalidArgument
from rota_serving import check_fixed_device, device_share_bytes, release_idle_cache
from rota_vllm._compat import require_vllm
from rota_vllm._pinned import (
    worker_load_begin,
    worker_load_end,
    worker_model,
    worker_prepare,
    worker_release,
    worker_save,
    worker_trim,
)

log = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")
BACKUPS = ("rota", "vllm")  # who keeps the weights over an OFFLOAD park


class TrackingError(InvalidArgument):
    """``track`` got an engine it cannot park (no sleep mode, tracked twice...)."""


_lock = threading.Lock()
_tracked: dict[int, TrackedLLM] = {}


def _load_weights_on_worker(worker: Any, named: list[tuple[str, Any]]) -> None:
    """Runs inside each vLLM worker (``collective_rpc``): load ``named`` tensors into its model."""
    worker_model(worker).load_weights(weights=named)


#: device bytes an awake engine's process holds beyond its ``gpu_memory_utilization`` share and the CUDA context it
#: had before vLLM started (kernels loaded into the context, libraries' workspaces, which vLLM's budget does not
#: count): 1,089 MiB measured for vLLM 0.26.0 on an H100 at 0.6 of the device (tests/cuda/test_vllm_cuda.py),
#: rounded up; counted in the footprint so that a capacity is not overrun by it
OUTSIDE_SHARE_BYTES = 1536 << 20


def awake_footprint(gpu_memory_utilization: float, device_total_bytes: int) -> int:
    """Device bytes an engine given ``gpu_memory_utilization`` of a device of ``device_total_bytes`` holds awake:
    what :func:`track` reports once it tracks it. Before the engine starts, give it to rota as the tenant's footprint
    hint (``rota.connect(..., footprint_hint=...)``): with a capacity, a tenant that has tracked nothing counts as 0
    bytes, so the turn the engine starts in would leave residents that "fit" beside it, and vLLM refuses to start
    when the device's free memory is below its share."""
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:
        raise InvalidArgument(f"gpu_memory_utilization={gpu_memory_utilization!r} must be a fraction in (0, 1], "
                              "as given to vllm.LLM")
    if isinstance(device_total_bytes, bool) or not isinstance(device_total_bytes, int) or device_total_bytes <= 0:
        raise InvalidArgument(f"device_total_bytes={device_total_bytes!r} must be the device's size in bytes "
                              "(torch.cuda.get_device_properties(i).total_memory)")
    return int(gpu_memory_utilization * device_total_bytes) + OUTSIDE_SHARE_BYTES

#: vLLM's worker ends its sleep with ``assert freed_bytes >= 0`` on the whole device's free memory: another
#: process allocating meanwhile (a trainer of another job, a restore) fails it after the sleep itself finished.
SLEEP_CHECK = "Memory usage increased after sleeping"


class _Steps:
    """Seconds of each step of one park or restore, each since the previous one ended (for benchmarks)."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._at = time.perf_counter()

    def done(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._at
        self._at = now


def _executor(llm: Any) -> Any:
    """The in-process engine's executor (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), or None where it is out of reach."""
    core = getattr(getattr(getattr(llm, "llm_engine", None), "engine_core", None), "engine_core", None)
    executor = getattr(core, "model_executor", None)
    return executor if hasattr(executor, "is_sleeping") else None


def _asleep(llm: Any) -> bool:
    """Whether vLLM has the engine asleep: its in-process executor's flag, else ``LLMEngine.is_sleeping()`` (a
    round trip to an engine core in another process, V1 multiprocessing), else False (an engine that cannot say)."""
    executor = _executor(llm)
    if executor is not None:
        return bool(executor.is_sleeping)
    ask = getattr(getattr(llm, "llm_engine", None), "is_sleeping", None)
    return bool(ask()) if callable(ask) else False


def _sleep(llm: Any, level: int) -> None:
    """``llm.sleep(level)``; if only vLLM's device-wide check failed, mark the in-process executor asleep (the
    check raised before vLLM recorded it), or re-raise naming why where the executor is in another process."""
    try:
        llm.sleep(level=level)
    except AssertionError as e:
        if SLEEP_CHECK not in str(e):
            raise
        executor = _executor(llm)
        if executor is None:
            raise RuntimeError("vLLM's sleep check failed because another process allocated device memory during "
                               "the sleep, and this engine's executor is in another process; run the LLM with "
                               "VLLM_ENABLE_V1_MULTIPROCESSING=0") from e
        executor.sleeping_tags, executor.is_sleeping = {"weights", "kv_cache"}, True
        log.info("vLLM's free-memory check after its sleep failed (another process allocated meanwhile); the "
                 "sleep itself finished, the executor is marked asleep")


class TrackedLLM:
    """One tracked ``LLM``; its hooks answer only for ``gpu``."""

    def __init__(self, gpu: Gpu, llm: Any, mode: ParkMode | None, backup: str = "vllm") -> None:
        self.gpu, self.llm, self.mode, self.backup = gpu, llm, mode, backup
        self.parked_level = 0  # 0 = awake
        self.stashed = False  # the weights are in rota's pool (an OFFLOAD park with backup="rota")
        self.stash_bytes = 0
        self.dropped: tuple[str, ...] = ()
        self.weights_stale = False  # after a level-2 park, until update_weights
        self.woken: tuple[str, ...] = ()  # tags a restore that failed half-way has woken already
        self.history: list[tuple[str, Any]] = []
        #: seconds of the last park's or restore's steps (save, sleep, trim / wake_weights, issue, wake_kv_cache,
        #: wait...), for benchmarks
        self.last_phases: dict[str, float] = {}
        self._name = f"rota-vllm-{gpu.tenant}-{id(llm):x}"
        cache = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "cache_config", None)
        #: device bytes the engine holds awake: its gpu_memory_utilization of the device and what it keeps outside
        #: that share (0: unknown)
        share = 0 if getattr(cache, "kv_cache_memory_bytes", None) else \
            device_share_bytes(getattr(cache, "gpu_memory_utilization", None))
        self.awake_bytes = share + OUTSIDE_SHARE_BYTES if share else 0  # as awake_footprint(util, device's total)

    def level_for(self, plan: ParkPlan) -> int:
        """The sleep level a park with ``plan`` uses: 2 for DISCARD (or weights in ``plan.discard``)."""
        mode = self.mode if self.mode is not None else plan.mode
        return 2 if mode == ParkMode.DISCARD or "weights" in plan.discard else 1

    @hookimpl
    def rota_park(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu or self.parked_level:
            return None
        if _asleep(self.llm):  # its weights' memory is unmapped: nothing to save from
            raise RuntimeError(f"the vLLM engine of job {tenant.tenant!r} is asleep, but rota did not put it to "
                               "sleep (LLM.sleep called directly?); park it through rota instead, e.g. "
                               "gpu.park(rota.ParkPlan(discard=frozenset({'weights'}))), or wake it up first")
        level = self.level_for(plan)
        t0 = time.perf_counter()
        steps = _Steps()
        self.last_phases = steps.phases
        stash = level == 1 and self.backup == "rota"
        if stash:
            self.llm.collective_rpc(worker_save)
            self.history.append(("save_weights", self.stash_bytes))
            level = 2
            steps.done("save")
        _sleep(self.llm, level)
        steps.done("sleep")
        self.llm.collective_rpc(worker_trim)
        release_idle_cache()  # weights pushed from this process were staged in its own cache
        steps.done("trim")
        self.parked_level, self.stashed = level, stash
        self.dropped = ("weights", "kv_cache") if level == 2 and not stash else ("kv_cache",)
        self.weights_stale = self.weights_stale or "weights" in self.dropped
        self.history.append(("sleep", level))
        log.info("vLLM of %s asleep at level %d (dropped %s%s)", tenant.tenant, level, ", ".join(self.dropped),
                 "; weights in rota's pool" if stash else "")
        return ParkResult(bytes_moved=self.stash_bytes if stash else 0, seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_restore(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu or not self.parked_level:
            return None
        t0 = time.perf_counter()
        steps = _Steps()
        self.last_phases = steps.phases
        wanted = [t for t in TAGS if plan.wants(t)]
        moved = self.stash_bytes if self.stashed else 0
        if self.stashed:  # weights first, then rota's copy into them, the KV cache woken while it runs
            if "weights" not in self.woken:  # a restore that failed half-way woke them already
                self._wake("weights")
                steps.done("wake_weights")
            self.llm.collective_rpc(worker_load_begin)
            self.history.append(("load_weights", self.stash_bytes))
            steps.done("issue")
            try:
                if "kv_cache" in wanted:
                    self._wake("kv_cache")
                    steps.done("wake_kv_cache")
            finally:  # the copies are waited for even if the KV cache's wake failed; a retry wakes only it
                self.llm.collective_rpc(worker_load_end)
                self.stashed = False
                steps.done("wait")
        elif self.parked_level == 2 and len(wanted) == len(TAGS):
            for tag in TAGS:  # weights first: room for a weight push
                if tag not in self.woken:  # a restore that failed half-way woke some already
                    self._wake(tag)
        elif len(wanted) == len(TAGS):
            self.llm.wake_up()
            self.history.append(("wake_up", None))
        else:
            self.llm.wake_up(tags=wanted)
            self.history.append(("wake_up", tuple(wanted)))
        self.parked_level, self.woken = 0, ()
        return ParkResult(bytes_moved=moved, seconds=time.perf_counter() - t0)

    def _wake(self, tag: str) -> None:
        """Wake one tag; remembered, so that a retry after a failure half-way does not wake it twice."""
        self.llm.wake_up(tags=[tag])
        self.woken += (tag,)
        self.history.append(("wake_up", (tag,)))

    @hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        """While awake, the device bytes vLLM allotted itself (``gpu_memory_utilization`` of the device: weights,
        activations, KV cache) and :data:`OUTSIDE_SHARE_BYTES`, so that a capacity counts the engine; 1 where the
        share is unknown (an explicit ``kv_cache_memory_bytes``, or CUDA not started in this process: an engine
        core of its own), still nonzero so the orchestrator parks the engine whenever another tenant needs the
        group; 0 asleep."""
        if tenant is not self.gpu:
            return None
        return {"engine": 0 if self.parked_level else max(1, self.awake_bytes)}

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]],
                       loader: Callable[[Any, list[tuple[str, Any]]], None] | None = None) -> int:
        """Push new weights (``(name, tensor)`` pairs, e.g. ``model.state_dict().items()``) into the engine.

        Call it inside a turn (the engine must be awake). Runs ``loader(worker, named)``
        on every vLLM worker through ``llm.collective_rpc`` (default: the model's own
        ``load_weights``), then resets vLLM's prefix cache (its cached KV was computed with the
        old weights); returns how many tensors were sent. With a multi-process
        engine vLLM pickles ``loader``: set ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` or
        pass a worker-extension method name via ``llm.collective_rpc`` yourself.
        """
        if self.parked_level:
            raise TrackingError(f"the vLLM engine of job {self.gpu.tenant!r} is asleep (level "
                                f"{self.parked_level}); push weights inside `with gpu.turn():`",
                                job_id=self.gpu.tenant, group_id=self.gpu.group)
        named = list(named_tensors)
        if not named:
            raise TrackingError("update_weights got no tensors; pass (name, tensor) pairs such as "
                                "model.state_dict().items()", job_id=self.gpu.tenant)
        for item in named:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
                raise TrackingError(f"update_weights: {type(item).__name__} {str(item)[:60]!r} is not a "
                                    "(name, tensor) pair", job_id=self.gpu.tenant)
        self.llm.collective_rpc(loader or _load_weights_on_worker, args=(named,))
        reset = getattr(self.llm, "reset_prefix_cache", None)  # cached prefixes hold KV of the old weights
        if callable(reset) and reset() is False:
            raise TrackingError("vLLM did not reset its prefix cache after new weights (a request still running?); "
                                "push weights between generate calls, or run the LLM with enable_prefix_caching=False",
                                job_id=self.gpu.tenant, group_id=self.gpu.group)
        self.weights_stale = False
        self.history.append(("update_weights", len(named)))
        return len(named)

    def untrack(self) -> None:
        """Stop parking this engine (wakes it first if parked)."""
        if self.parked_level:
            self.rota_restore(self.gpu, ParkPlan())
        if self.backup == "rota":
            self.llm.collective_rpc(worker_release)
        self.gpu.pm.unregister(name=self._name)
        with _lock:
            _tracked.pop(id(self.llm), None)


def track(gpu: Gpu, llm: Any, *, mode: ParkMode | str | None = None, backup: str = "rota",
          check_version: bool = True) -> TrackedLLM:
    """Let rota park ``llm`` (a ``vllm.LLM`` built with ``enable_sleep_mode=True``) between ``gpu``'s turns.

    :param mode: force ``"offload"`` (sleep level 1) or ``"discard"`` (level 2) for every
        park; default: the park plan's mode (OFFLOAD unless the orchestrator or agent says).
    :param backup: who keeps the weights over an OFFLOAD park: ``"rota"`` (rota's pinned pool, reserved now in
        each worker, then a level-2 sleep) or ``"vllm"`` (vLLM's level-1 sleep).
    :param check_version: check the installed vLLM first (off only for fakes in tests).
    :raises rota_vllm.UnsupportedVersion: vLLM missing or outside the targeted versions.
    :raises TrackingError: ``llm`` has no sleep mode, or is already tracked.
    :raises rota.errors.ConfigError: ``gpu`` names several devices (an engine cannot move between them).
    """
    if check_version:
        require_vllm()
    check_fixed_device(gpu.devices, f"the vllm.LLM of tenant {gpu.tenant!r}")
    if mode is not None and not isinstance(mode, ParkMode):
        try:
            mode = ParkMode(mode)
        except ValueError:
            raise TrackingError(f"mode={mode!r} is not 'offload' (sleep level 1) or 'discard' (level 2)",
                                job_id=gpu.tenant) from None
    if backup not in BACKUPS:
        raise TrackingError(f"backup={backup!r} is not 'rota' (rota's pinned pool, level-2 sleep) or 'vllm' "
                            "(vLLM's level-1 sleep)", job_id=gpu.tenant)
    for attr in ("sleep", "wake_up", "collective_rpc"):
        if not callable(getattr(llm, attr, None)):
            raise TrackingError(f"{type(llm).__name__} has no {attr}(); pass a vllm.LLM (vLLM >= 0.10)",
                                job_id=gpu.tenant, group_id=gpu.group)
    cfg = getattr(getattr(getattr(llm, "llm_engine", None), "vllm_config", None), "model_config", None)
    if cfg is not None and getattr(cfg, "enable_sleep_mode", True) is False:
        raise TrackingError("this LLM was built without sleep mode; create it with "
                            "LLM(..., enable_sleep_mode=True)", job_id=gpu.tenant, group_id=gpu.group)
    with _lock:
        if id(llm) in _tracked:
            raise TrackingError(f"this LLM is already tracked by job {_tracked[id(llm)].gpu.tenant!r}; call "
                                "untrack() first", job_id=gpu.tenant)
        tracked = _tracked[id(llm)] = TrackedLLM(gpu, llm, mode, backup)
    if backup == "rota":
        try:
            tracked.stash_bytes = sum(int(n) for n in llm.collective_rpc(worker_prepare))
        except Exception as e:
            with _lock:
                _tracked.pop(id(llm), None)
            raise TrackingError("could not reserve rota's copy of the weights in the vLLM workers "
                                f"({type(e).__name__}: {str(e)[:200]}); in an engine with worker processes set "
                                "VLLM_ALLOW_INSECURE_SERIALIZATION=1, or pass backup='vllm'", job_id=gpu.tenant) from e
    gpu.pm.register(tracked, name=tracked._name)
    return tracked


__all__ = ["BACKUPS", "TAGS", "TrackedLLM", "TrackingError", "track"]
