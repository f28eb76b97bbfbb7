"""Device memory through NVML (``nvidia-ml-py``), else nothing: per GPU and per process.

The only module of rota that imports ``pynvml``; without it, or without a GPU, every
function here answers None or an empty list. Used by the agent (its Status lists the
node's accelerators; its residue check reads what a parked job's pids still hold) and by
:mod:`rota_torch` (a tenant's bytes outside torch's allocator). No torch here.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)
_lock = threading.Lock()  # guards the one-time nvmlInit; a leaf lock: nothing is taken while it is held
_state: dict[str, object] = {}


def _nvml() -> object | None:
    with _lock:
        if "mod" not in _state:
            try:
                import pynvml

                pynvml.nvmlInit()
                _state["mod"] = pynvml
            except Exception as exc:  # no package, no driver, no GPU: report none
                log.info("NVML unavailable (%s): no accelerators or per-process bytes are reported", exc)
                _state["mod"] = None
        return _state["mod"]


def accelerators() -> list[tuple[str, int, int]]:
    """(uuid, used bytes, total bytes) per GPU of this node."""
    nv = _nvml()
    if nv is None:
        return []
    out = []
    try:
        for i in range(nv.nvmlDeviceGetCount()):  # type: ignore[attr-defined]
            h = nv.nvmlDeviceGetHandleByIndex(i)  # type: ignore[attr-defined]
            mem = nv.nvmlDeviceGetMemoryInfo(h)  # type: ignore[attr-defined]
            uuid = nv.nvmlDeviceGetUUID(h)  # type: ignore[attr-defined]
            out.append((uuid.decode() if isinstance(uuid, bytes) else str(uuid), int(mem.used), int(mem.total)))
    except Exception as exc:
        log.warning("NVML query failed: %s", exc)
    return out


def process_bytes_by_pid(pids: tuple[int, ...]) -> dict[int, int] | None:
    """Device bytes each of ``pids`` uses, summed over all GPUs (None without NVML).

    A pid NVML does not list holds nothing (0). Blocking: call it off an event loop.
    """
    nv = _nvml()
    if nv is None:
        return None
    out = dict.fromkeys(pids, 0)
    try:
        for i in range(nv.nvmlDeviceGetCount()):  # type: ignore[attr-defined]
            h = nv.nvmlDeviceGetHandleByIndex(i)  # type: ignore[attr-defined]
            for p in nv.nvmlDeviceGetComputeRunningProcesses(h):  # type: ignore[attr-defined]
                if p.pid in out and p.usedGpuMemory:
                    out[p.pid] += int(p.usedGpuMemory)
    except Exception as exc:
        log.warning("NVML per-process query failed: %s", exc)
        return None
    return out


def process_bytes(pids: tuple[int, ...]) -> int | None:
    """Device bytes used by ``pids`` across all GPUs (None without NVML)."""
    per = process_bytes_by_pid(pids)
    return None if per is None else sum(per.values())


def device_process_bytes(nvml_index: int, pid: int) -> int | None:
    """Bytes process ``pid`` uses on the GPU NVML numbers ``nvml_index`` (None without NVML)."""
    nv = _nvml()
    if nv is None:
        return None
    try:
        handle = nv.nvmlDeviceGetHandleByIndex(nvml_index)  # type: ignore[attr-defined]
        procs = nv.nvmlDeviceGetComputeRunningProcesses(handle)  # type: ignore[attr-defined]
    except Exception as exc:
        log.debug("NVML per-process query failed: %s", exc)
        return None
    return sum(int(p.usedGpuMemory or 0) for p in procs if p.pid == pid)
