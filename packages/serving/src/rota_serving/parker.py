"""Park hooks of a tenant whose state is an engine behind HTTP, and what the in-process engine adapters
(rota_vllm's and rota_sglang's ``track``) share with them: the one-device check, the release of the
tenant process's idle CUDA cache at a park, and the device bytes of an engine's share of the device.

Who calls it: ``serve_app`` registers an :class:`EndpointParker` on the served tenant's
``Gpu``; rota then runs its ``rota_park``/``rota_restore`` when the orchestrator (or the
node agent) parks the engine between turns. The plan maps to the engine's own sleep
API (vLLM: OFFLOAD → ``/sleep?level=1``, DISCARD → ``level=2``; SGLang: release with
the plan's tags).
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Sequence

from rota import Gpu, ParkMode, ParkPlan, ParkResult, hookimpl
from rota.errors import ConfigError, InvalidArgument
from rota_serving.endpoint import EndpointClient, ServingError
from rota_serving.engines import APP_TAGS, VLLM, check_tags

log = logging.getLogger(__name__)


def check_fixed_device(devices: Sequence[str], what: str) -> None:
    """Refuse several devices for an engine's tenant: an inference engine (vLLM, SGLang) runs on the GPU it
    started on and cannot follow a turn placed on another (its park hooks cannot move it), so rota must never
    place one there. One device (the engine's own) or none is right.

    :raises ConfigError: ``devices`` names more than one; the message says what to name instead.
    """
    if len(devices) > 1:
        raise ConfigError(f"devices {','.join(devices)} (ROTA_DEVICES or devices=) name several GPUs, but {what} "
                          "runs on the GPU it started on and cannot move between turns; name only the engine's "
                          "device as it sees it (ROTA_DEVICES=cuda:0), or none")


def release_idle_cache() -> int:
    """Hand this process's idle cached CUDA blocks back to the driver, at an in-process engine's park.

    The engine's own memory lives in its scheduler or worker processes, but weights pushed from this process
    (``update_weights`` with tensors made here) are staged in this process's caching allocator, which NVML counts
    against the parked tenant and no other process can use. Does nothing where torch has not started CUDA here
    (torch is never imported for it). Returns the bytes handed back.
    """
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return 0
    before = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    return max(0, before - torch.cuda.memory_reserved())


def device_share_bytes(share: float | None) -> int:
    """``share`` of this process's current CUDA device's memory, in bytes; 0 where unknown (no share, or torch
    has not started CUDA here: torch is never imported for it).

    What an in-process engine given that share holds while awake (vLLM's ``gpu_memory_utilization``: it sizes its
    KV cache to fill it), reported as its footprint so that a ``--capacity`` counts it.
    """
    torch = sys.modules.get("torch")
    if not share or not 0 < share <= 1 or torch is None or not torch.cuda.is_initialized():
        return 0
    return int(share * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)


class EndpointParker:
    """rota_park / rota_restore of one tenant whose state is an engine behind HTTP.

    Registered on ``gpu.pm`` by :func:`track_endpoint`; answers only for its ``gpu``.
    ``mode`` forces a park mode (e.g. DISCARD in RL, where the trainer pushes fresh
    weights every step); else the plan's mode is used. ``dropped`` lists the tags the
    last park lost (their contents must be recomputed or pushed again).
    """

    def __init__(self, gpu: Gpu, client: EndpointClient, *, mode: ParkMode | None = None,
                 tags: Sequence[str] = (), footprint_bytes: int = 0) -> None:
        if footprint_bytes < 0:
            raise InvalidArgument(f"footprint_bytes={footprint_bytes} must be >= 0 (0 = unknown)")
        self.gpu, self.client, self.mode = gpu, client, mode
        self.footprint_bytes = footprint_bytes
        self.tags = check_tags(client.app, tags, "park tags")
        self.parked = False
        self.dropped: tuple[str, ...] = ()
        self.history: list[tuple[str, str, tuple[str, ...]]] = []  # (park|restore, mode, tags)

    def _mode(self, plan: ParkPlan) -> ParkMode:
        if self.mode is not None:
            return self.mode
        if plan.mode == ParkMode.DISCARD or "weights" in plan.discard:
            return ParkMode.DISCARD
        return ParkMode.OFFLOAD

    @hookimpl
    def rota_park(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu:
            return None
        t0 = time.perf_counter()
        mode = self._mode(plan)
        tags = tuple(t for t in sorted(plan.tags) if t in APP_TAGS[self.client.app]) if plan.tags else self.tags
        self.client.sleep(mode, tags)
        self.parked = True
        if self.client.app == VLLM:
            # level 1 offloads weights and drops the KV cache; level 2 drops both
            self.dropped = ("weights", "kv_cache") if mode == ParkMode.DISCARD else ("kv_cache",)
        else:  # SGLang: the KV cache released is gone; the weights too, unless the engine backs them up
            released = set(tags or APP_TAGS[self.client.app])
            self.dropped = tuple(t for t in ("weights", "kv_cache")
                                 if t in released and (t == "kv_cache" or not self.client.keeps_weights))
        self.history.append(("park", mode.value, tags))
        log.info("%s %s parked (%s, tags=%s; dropped %s)", self.client.app, self.client.base_url, mode.value,
                 ",".join(tags) or "all", ",".join(self.dropped) or "nothing")
        return ParkResult(seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_restore(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu or not self.parked:
            return None
        t0 = time.perf_counter()
        self.client.wake(())
        self.parked = False
        self.history.append(("restore", "", ()))
        log.info("%s %s woken", self.client.app, self.client.base_url)
        return ParkResult(seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        """The engine's device bytes while awake: ``footprint_bytes``, or 1 when unknown.

        An awake engine always holds device memory, and the orchestrator parks only
        residents with a footprint, so "unknown" is reported as 1 byte (park it
        whenever another tenant needs the group). A parked engine reports 0.
        """
        if tenant is not self.gpu:
            return None
        return {"engine": 0 if self.parked else (self.footprint_bytes or 1)}


def wait_attached(gpu: Gpu, timeout_s: float = 30.0) -> None:
    """Block until the orchestrator lists ``gpu``'s tenant (its session is attached).

    The orchestrator parks a resident only over a live session; a request served
    before the session is attached could otherwise hold the GPU unparkable.
    """
    from rota.wire import rota_v1_pb2 as v1

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            reply = gpu.stub.Status(v1.StatusRequest(group_id=gpu.group), timeout=5)
            if any(t.job_id == gpu.tenant for g in reply.groups for t in g.tenants):
                return
        time.sleep(0.05)
    raise ServingError(f"the rota session of {gpu.tenant!r} (group {gpu.group!r}) did not attach to "
                       f"{gpu.endpoint} within {timeout_s:g} s; is the orchestrator reachable?",
                       job_id=gpu.tenant, group_id=gpu.group)


def track_endpoint(gpu: Gpu, client: EndpointClient, *, mode: ParkMode | None = None,
                   tags: Sequence[str] = (), footprint_bytes: int = 0) -> EndpointParker:
    """Register an :class:`EndpointParker` for ``client`` on ``gpu``'s plugin manager.

    :raises ConfigError: ``gpu`` names several devices (:func:`check_fixed_device`).
    """
    check_fixed_device(gpu.devices, f"the {client.app} engine of tenant {gpu.tenant!r}")
    parker = EndpointParker(gpu, client, mode=mode, tags=tags, footprint_bytes=footprint_bytes)
    gpu.pm.register(parker, name=f"rota-endpoint-{gpu.tenant}-{id(parker):x}")
    return parker



__all__ = ["EndpointParker", "check_fixed_device", "track_endpoint", "wait_attached"]
