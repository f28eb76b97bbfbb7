"""How much memory a ``rota demo`` run needs, checked before anything starts: what ``--capacity auto`` means
(the device less a margin), whether the largest LLM job fits the device alone, and the peak host memory of its
modes (pinned pools, push buffers, models on the host, each process's runtime) against what the host has.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rota.errors import PermanentError
from rota_demo.llm_engines import PUSH_DTYPE

if TYPE_CHECKING:
    from rota_demo.runner import DemoConfig

__all__ = ["CAPACITY_MARGIN_MIN", "CAPACITY_MARGIN_SHARE", "RUNTIME_BYTES", "DeviceMemoryShort", "HostMemoryPlan",
           "HostMemoryShort", "auto_capacity", "available_host_bytes", "capacity_margin", "check_device_fits",
           "cuda_total_bytes", "host_memory_plan", "push_plan"]

# Host memory of one process besides the demo's tensors: interpreter and torch, plus the CUDA context on cuda.
RUNTIME_BYTES = {"cpu": 400 * 10**6, "cuda": 2 * 10**9}


#: --capacity auto on CUDA: the device's memory less this share of it (at least CAPACITY_MARGIN_MIN), for the CUDA
#: contexts of the workers and their steps' temporaries, which no footprint counts; split between the groups that
#: share one device.
CAPACITY_MARGIN_SHARE = 0.10
CAPACITY_MARGIN_MIN = 8 << 30


def capacity_margin(total: int) -> int:
    """Bytes of a device of ``total`` bytes kept out of ``--capacity auto`` (and out of what one LLM job may need
    alone): max(CAPACITY_MARGIN_SHARE of it, CAPACITY_MARGIN_MIN)."""
    return max(CAPACITY_MARGIN_MIN, int(total * CAPACITY_MARGIN_SHARE))


def cuda_total_bytes(device: str) -> int:
    """Bytes of the CUDA device ``device`` (``cuda``, ``cuda:1``); 0 for any other (no device size to fit in)."""
    import torch

    on = torch.device(device)
    return torch.cuda.get_device_properties(on.index or 0).total_memory if on.type == "cuda" else 0


def auto_capacity(device: str, groups: int, elastic: bool) -> tuple[int, str]:
    """(bytes per group, how): what ``--capacity auto`` means for this run.

    On CUDA, what the device holds less the margin, so states that fit stay resident and a switch parks only
    when memory requires it. On CPU, 0: there is no device size to fit in, and every switch parks.
    """
    if not device.startswith("cuda"):
        return 0, "auto on cpu: 0, every switch parks"
    import torch

    index, total = torch.device(device).index or 0, cuda_total_bytes(device)
    margin = capacity_margin(total)
    sharing = groups if groups == 2 and not elastic and (":" in device or torch.cuda.device_count() < 2) else 1
    per_group = max(total - margin, 0) // sharing
    shared = f", split between the {sharing} groups on it" if sharing > 1 else ""
    return per_group, (f"auto: {torch.cuda.get_device_name(index)} holds {total / 2**30:.1f} GiB, less a margin of "
                       f"{margin / 2**30:.1f} GiB (max({CAPACITY_MARGIN_SHARE:.0%}, {CAPACITY_MARGIN_MIN >> 30} GiB), "
                       f"for CUDA contexts and temporaries){shared}: {per_group / 2**30:.1f} GiB per group")


class HostMemoryShort(PermanentError):
    """The demo would need more host memory than the machine has available; refused before starting."""


class DeviceMemoryShort(PermanentError):
    """An LLM job alone would not fit the device (its trainer, its step and its engine); refused before starting."""


def check_device_fits(cfg: DemoConfig) -> None:
    """Refuse ``--llm-size`` shapes whose largest job cannot run alone on the device (dedicated mode runs each
    job's trainer and engine at once), before checkpoints are built; nothing to check for the toy jobs or CPU."""
    if not cfg.llm_sizes or not cfg.device.startswith("cuda"):
        return
    import torch

    index, total = torch.device(cfg.device).index or 0, cuda_total_bytes(cfg.device)
    room = total - capacity_margin(total)
    need, job, size = max((size.device_bytes(cfg.engine, total), job, size) for job, size in cfg.sized_jobs())
    if need > room:
        raise DeviceMemoryShort(
            f"job {job} of these --llm-size shapes needs about {need / 2**30:.1f} GiB of device memory alone (its "
            f"trainer's state {size.trainer_state_bytes / 2**30:.1f} GiB, its step's bf16 weights "
            f"{size.params * 2 / 2**30:.1f} GiB, its {cfg.engine} engine), but {torch.cuda.get_device_name(index)} "
            f"has {room / 2**30:.1f} GiB besides the margin for contexts and activations; use a device with more "
            f"memory (the h200 shapes are for one H200, the h100 shapes for an 80 GB card) or --llm-size tiny")


@dataclass(frozen=True)
class HostMemoryPlan:
    """Host bytes the demo needs at its peak: the largest of its modes (they run one after another)."""

    mode: str  # the mode with the peak
    pools: int  # host pools rota_fsdp parks into (pinned on CUDA); time-sliced only
    push: int  # shared weight-push buffers, one per job running at once
    models: int  # the models themselves, when they live on the host (--device cpu)
    runtime: int  # interpreter, torch (and CUDA context) of every worker and of this process
    trainer_state: int  # one trainer's state, to scale a fix
    available: int | None  # bytes available to this process tree; None when unknown
    source: str  # where ``available`` came from

    @property
    def total(self) -> int:
        return self.pools + self.push + self.models + self.runtime

    def describe(self) -> str:
        """One line for the run's header."""
        have = f"{self.available / 1e9:.1f} GB available ({self.source})" if self.available is not None \
            else f"available host memory unknown ({self.source})"
        return (f"host memory: about {self.total / 1e9:.1f} GB at peak ({self.mode}: host pools "
                f"{self.pools / 1e9:.1f} GB + push buffers {self.push / 1e9:.1f} GB + models on the host "
                f"{self.models / 1e9:.1f} GB + runtime {self.runtime / 1e9:.1f} GB); {have}")

    def check(self) -> None:
        """Refuse a run that would not fit, before any worker starts (instead of an OOM kill mid-run)."""
        if self.available is None or self.total <= self.available:
            return
        per_state_byte = (self.total - self.runtime) / self.trainer_state
        fits = (self.available - self.runtime) / per_state_byte
        hint = (f"use a smaller --state (about {fits / 1e9:.1f}GB per trainer would fit) or free host memory"
                if fits > 0 else "free host memory (the runtime alone does not fit)")
        if self.source != "--host-memory":
            hint += ("; where MemAvailable under-reads (a VM whose memory grows as it is used), pass "
                     "--host-memory with what the machine really has free")
        raise HostMemoryShort(f"rota demo needs about {self.total / 1e9:.1f} GB of host memory at its peak "
                              f"({self.mode}: host pools {self.pools / 1e9:.1f} GB, push buffers "
                              f"{self.push / 1e9:.1f} GB, models on the host {self.models / 1e9:.1f} GB, "
                              f"runtime {self.runtime / 1e9:.1f} GB) but only {self.available / 1e9:.1f} GB is "
                              f"available ({self.source}); {hint}")


def push_plan(engine: str, size: Any) -> tuple[int, str | None]:
    """(bytes, dtype) of one job's push buffer: its weights in the dtype its engine holds (PUSH_DTYPE)."""
    dtype = PUSH_DTYPE.get(engine)
    return (size.push_bytes_as(dtype) if dtype else size.push_bytes), dtype


def host_memory_plan(cfg: DemoConfig) -> HostMemoryPlan:
    """Estimate the demo's peak host memory, against ``--host-memory`` or else :func:`available_host_bytes`."""
    available: int | None
    if cfg.host_memory_bytes:
        available, source = cfg.host_memory_bytes, "--host-memory"
    else:
        available, source = available_host_bytes()
    sizes, on_host = [size for _, size in cfg.sized_jobs()], cfg.device == "cpu"
    runtime = RUNTIME_BYTES["cpu" if on_host else "cuda"]
    plans = []
    for mode in cfg.modes:
        # dedicated and serial run one job at a time: the largest is their peak; time-sliced runs them all
        run = sizes if mode == "timesliced" else [max(sizes, key=lambda s: s.trainer_state_bytes)]
        if cfg.engine == "vllm":  # rota_vllm reserves each engine's pool (its bf16 weights) when it tracks it
            sampler_pools = sum(s.engine_pool_bytes for s in run)
        else:  # a sampler parked by rota_fsdp pins its pool at setup only where every switch parks
            sampler_pools = sum(s.weight_bytes for s in run) if cfg.capacity_bytes == 0 else 0
        pools = sum(s.trainer_state_bytes for s in run) + sampler_pools if mode == "timesliced" else 0
        models = sum(s.trainer_state_bytes + s.weight_bytes for s in run) if on_host else 0
        push = sum(push_plan(cfg.engine, s)[0] for s in run)
        plans.append(HostMemoryPlan(mode=mode, pools=pools, push=push, models=models,
                                    runtime=(2 * len(run) + 1) * runtime, trainer_state=run[0].trainer_state_bytes,
                                    available=available, source=source))
    return max(plans, key=lambda p: p.total)


def available_host_bytes() -> tuple[int | None, str]:
    """(bytes, source): MemAvailable, or the memory cgroup's room when that is smaller (either can OOM-kill)."""
    best: tuple[int | None, str] = (None, "no /proc/meminfo")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    best = (int(line.split()[1]) * 1024, "MemAvailable")
    except OSError:
        pass
    room = _cgroup_room()
    if room is not None and (best[0] is None or room < best[0]):
        best = (room, "memory cgroup limit")
    return best


def _cgroup_room() -> int | None:
    """Limit minus non-reclaimable usage of this process's memory cgroup (v2, else v1); None if unlimited."""
    for limit_f, usage_f, stat_f, key in (
            ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
             "inactive_file"),
            ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
             "/sys/fs/cgroup/memory/memory.stat", "total_inactive_file")):
        if not os.path.exists(limit_f):
            continue
        try:
            with open(limit_f) as f:
                raw = f.read().strip()
            if raw == "max" or int(raw) >= 1 << 60:
                return None
            with open(usage_f) as f:
                usage = int(f.read())
            with open(stat_f) as f:
                inactive = next((int(line.split()[1]) for line in f if line.split()[0] == key), 0)
        except (OSError, ValueError):
            return None
        return max(int(raw) - (usage - inactive), 0)
    return None
