"""What a parked process still holds, read by NVML: right after every park, and by pid.

Those children run as scripts (``python tests/cuda/test_*.py ...``), so they import this as ``park_probe`` from
their own folder.
"""

from __future__ import annotations

from typing import Any


def nvml_after_parks(gpu: Any) -> list[int | None]:
    """Register a park hook on ``gpu`` that runs after every other (trylast) and appends this process's NVML
    bytes on ``cuda:0`` (None without NVML) to the list returned; each park adds one entry."""
    import torch

    import rota
    from rota_torch import process_device_bytes

    after: list[int | None] = []

    class NvmlAfterPark:
        @rota.hookimpl(trylast=True)
        def rota_park(self, tenant: object, plan: object) -> None:
            torch.cuda.synchronize()
            after.append(process_device_bytes("cuda:0"))

    gpu.pm.register(NvmlAfterPark(), name="nvml-after-park")
    return after


def device_processes() -> dict[int, int]:
    """NVML's bytes of every process on device 0, by pid (what a wake competes with; a served engine's)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    return {p.pid: p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
