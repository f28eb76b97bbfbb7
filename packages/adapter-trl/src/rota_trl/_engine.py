"""The vLLM engine of a TRL GRPO job in ``vllm_mode="colocate"``, as part of the job's park.

Who uses it: :class:`rota_trl.RotaCallback` registers one :class:`ColocatedEngine` on its tenant's plugin
manager when the trainer generates with vLLM in its own process (``trainer.vllm_generation.llm``).

TRL moves this engine's memory itself: with ``vllm_enable_sleep_mode=True`` it puts the engine to sleep at
level 2 after every generation (weights and KV cache freed) and wakes it (``wake_up(tags=["weights"])``, a
weight push, then the KV cache) before the next. A turn ends after the optimizer step, so the engine is
asleep whenever rota parks the job; rota does not sleep or wake it (TRL's own bookkeeping would go wrong).
A park checks that the engine is asleep (else the park fails, naming it: the job would keep the engine's
memory on the device) and empties torch's cache of freed blocks, so what the engine freed goes back to the
driver; the residue of the job is measured by the model's handle (``rota_fsdp``) as for any park.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from rota import Gpu, ParkPlan, ParkResult, hookimpl
from rota.errors import InvalidArgument

log = logging.getLogger(__name__)

__all__ = ["ColocatedEngine", "EngineAwake", "engine_of"]


class EngineAwake(InvalidArgument):
    """A park found the colocated vLLM engine awake: its memory would stay on the device."""


def engine_of(trainer: Any) -> Any:
    """The in-process vLLM ``LLM`` of a TRL trainer in colocate mode (``trainer.vllm_generation.llm``), or None."""
    generation = getattr(trainer, "vllm_generation", None)
    return getattr(generation, "llm", None)


def is_sleeping(llm: Any) -> bool | None:
    """Whether vLLM says the engine sleeps (``llm.llm_engine.is_sleeping()``); None when it cannot tell."""
    engine = getattr(llm, "llm_engine", None)
    probe = getattr(engine, "is_sleeping", None)
    if probe is None:
        return None
    answer = probe() if callable(probe) else probe
    return bool(answer)


class ColocatedEngine:
    """rota hooks for one tenant's colocated vLLM engine: a park verifies TRL's level-2 sleep."""

    def __init__(self, gpu: Gpu, llm: Any, device_bytes: int = 1) -> None:
        self.gpu, self.llm, self.device_bytes = gpu, llm, max(1, int(device_bytes))
        self.parks = 0
        self.name = f"rota-trl-engine-{gpu.tenant}-{id(llm):x}"

    @hookimpl
    def rota_park(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu:
            return None
        t0 = time.perf_counter()
        sleeping = is_sleeping(self.llm)
        if sleeping is False:
            raise EngineAwake(f"the vLLM engine of job {tenant.tenant!r} is awake at a park: TRL puts it to sleep "
                              "after each generation only with vllm_enable_sleep_mode=True (set it in the "
                              "GRPOConfig)", job_id=tenant.tenant, group_id=tenant.group)
        self.parks += 1
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # what the engine freed, back to the driver for the next holder
        except ImportError:  # pragma: no cover - rota_trl depends on torch through rota-torch
            pass
        return ParkResult(seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_restore(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        return None  # TRL wakes the engine itself, before its next generation, inside the turn

    @hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        """The engine's share of the device while awake (``gpu_memory_utilization`` of it): what a turn needs."""
        return {"vllm_engine": self.device_bytes} if tenant is self.gpu else None


def engine_bytes(llm: Any) -> int:
    """Device bytes the engine takes awake: ``gpu_memory_utilization`` x the device's memory (1 when unknown)."""
    try:
        import torch

        share = float(llm.llm_engine.vllm_config.cache_config.gpu_memory_utilization)
        if torch.cuda.is_available() and 0 < share <= 1:
            return int(share * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except (AttributeError, TypeError, ValueError):
        pass
    return 1
