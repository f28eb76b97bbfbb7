"""What a parked process still holds, read by NVML: right after every park, and by pid.

Those children run as scripts (``python tests/cuda/test_*.py ...``), so they import this as ``park_probe`` from
their own folder.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def others_bytes(exclude: int) -> list[int]:
    """NVML bytes of every process on device 0 but ``exclude`` (an engine's, one entry per process), largest
    first: each is its CUDA context (grown by the kernels it loaded) plus what it holds or its park left."""
    return sorted((n for pid, n in device_processes().items() if pid != exclude), reverse=True)


@functools.cache
def bare_context_mib() -> int:
    """NVML MiB of a fresh process that made its CUDA context and one small tensor: the floor a parked
    process's own figure is compared with (an engine's is larger by the kernels it loaded)."""
    code = ("import os, torch, pynvml; torch.zeros(1, device='cuda'); torch.cuda.synchronize(); pynvml.nvmlInit(); "
            "h = pynvml.nvmlDeviceGetHandleByIndex(0); "
            "print(sum(p.usedGpuMemory or 0 for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h) "
            "if p.pid == os.getpid()) >> 20)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              timeout=120).stdout.split()[-1])


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


def fill_fits(nbytes: int) -> bool:
    """Whether ``nbytes`` of device 0 could be allocated and written by this process; the tensor is gone on
    return (what another job's turn needs after a park freed the device).

    Why a function: at 7daf63b a test's check was ``fill.sum(dtype=torch.int64)``, which makes an int64 copy (8x
    the fill) and ran out of memory; the raise skipped the ``del``, so the loop's ``fill`` kept 82 GB across a
    park and the engine's wake found no room. ``min`` reduces in uint8, and a local dies on return.
    """
    import torch

    try:
        fill = torch.ones(nbytes, dtype=torch.uint8, device="cuda:0")
        return int(fill.min().item()) == 1
    except torch.OutOfMemoryError:
        return False


def wait_for_count(path: Path, n: int, who: str, timeout: float = 300.0, proc: Any = None) -> None:
    """Until ``path`` holds a count of at least ``n``, written by ``who`` (turns taken so far): two processes
    that alternate on the device wait for each other's turns this way. With ``proc`` (``who``'s Popen), stop
    at once when it has exited: an engine that died at start-up is not waited for until the timeout."""
    deadline = time.monotonic() + timeout
    while not (path.exists() and int(path.read_text() or 0) >= n):
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"{who} exited {proc.returncode} before turn {n} ({path})")
        if time.monotonic() > deadline:
            raise SystemExit(f"{who} did not take turn {n} within {timeout:.0f} s ({path})")
        time.sleep(0.05)


def write_count(path: Path, n: int) -> None:
    """Write count ``n`` to ``path`` whole (a reader never sees half of it)."""
    path.with_suffix(".tmp").write_text(str(n))
    path.with_suffix(".tmp").replace(path)
