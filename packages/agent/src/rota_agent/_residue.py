"""Verified release: what a parked job still holds on the device, and whether that is a fault.

The agent (:mod:`rota_agent._agent`) calls :func:`measure` after every successful
snapshot. Two sources, both kept in the report by key: the residue the tenant's
adapters computed (:attr:`rota.ParkResult.residue`, sent back in the CommandResult),
and NVML per-process used memory of the job's pids (``nvml:pid:PID``, through an
injectable reader; tests pass a fake).

What is *counted* against the limit: the adapters' part as core counts it
(:func:`rota.residue.residue_counted`) and, for whole-process backends (``cuda``, where
the driver releases the CUDA context too), the NVML bytes of the pids. For backends
whose process stays alive, NVML bytes include the CUDA context (hundreds of MiB that no
park can free), so they are reported but not counted.

Wire: the report travels in rota-owned fields (numbered from 1000) appended to
v1alpha1 messages, which v1alpha1 peers ignore (:mod:`rota_agent_client.extension`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from google.protobuf.message import Message

from rota.errors import ConfigError
from rota.residue import RESIDUE_ENV, residue_counted, residue_fault, residue_max_bytes
from rota.types import ParkResult
from rota_agent_client.extension import ext

NVML_PREFIX = "nvml:pid:"

M = TypeVar("M", bound=Message)
ProcessReader = Callable[[tuple[int, ...]], "dict[int, int] | None"]  # pid -> device bytes; None = unknown


def residue_max(value: int | None = None) -> int:
    """``value`` (a flag) when given, else ``ROTA_RESIDUE_MAX_BYTES`` (default 256 MiB), validated."""
    if value is None:
        return residue_max_bytes()
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"residue_max_bytes={value!r} is not an integer >= 0; pass bytes (0 disables the check) "
                          f"or leave it unset to use {RESIDUE_ENV}")
    return value


@dataclass
class Residue:
    """What one park left on the device, and the verdict."""

    by_key: dict[str, int] = field(default_factory=dict)
    counted: int = 0
    limit: int = 0
    fault: str = ""  # "" = within the limit

    def to_pb(self) -> ext.Residue:
        return ext.Residue(bytes=self.by_key, counted_bytes=self.counted, limit_bytes=self.limit)


MAX_KEYS, MAX_KEY_CHARS = 32, 128  # what a tenant's report may name; it travels in every Status reply
REST = "untracked:(more)"  # where the bytes of keys over those bounds are summed (still counted)


def merge(parts: list[Mapping[str, int]]) -> dict[str, int]:
    """Residue of several processes (ranks) of one job: every key summed, since each rank is its own process.

    Bounded: at most ``MAX_KEYS`` keys of at most ``MAX_KEY_CHARS`` characters; the smallest
    and the overlong ones are summed under ``REST``, so the total still counts (the
    allocator's ``process:`` totals are always kept as they are).
    """
    out: dict[str, int] = {}
    for part in parts:
        for k, n in part.items():
            k = k if len(k) <= MAX_KEY_CHARS and k.isprintable() else REST
            out[k] = out.get(k, 0) + max(0, int(n))
    if len(out) <= MAX_KEYS:
        return out
    kept = dict(sorted(out.items(), key=lambda kv: (not kv[0].startswith("process:"), -kv[1]))[:MAX_KEYS - 1])
    kept[REST] = kept.get(REST, 0) + sum(n for k, n in out.items() if k not in kept)
    return kept


def measure(job_id: str, backend: str, adapter: Mapping[str, int], nvml: Mapping[int, int] | None,
            *, count_nvml: bool, limit: int) -> Residue:
    """Combine the adapters' residue and NVML's per-pid bytes; judge it against ``limit``."""
    by_key = {k: int(v) for k, v in adapter.items()}
    pids = {pid: int(n) for pid, n in (nvml or {}).items()}
    by_key.update({f"{NVML_PREFIX}{pid}": n for pid, n in pids.items()})
    adapter_counted = int(residue_counted(adapter))
    nvml_counted = sum(pids.values()) if count_nvml else 0
    res = Residue(by_key, max(adapter_counted, nvml_counted), limit)
    if limit <= 0 or res.counted <= limit:
        return res
    what = []
    if nvml_counted > limit:
        what.append("NVML: " + ", ".join(f"pid {pid} holds {n / 2**20:.1f} MiB"
                                        for pid, n in sorted(pids.items(), key=lambda kv: -kv[1]) if n))
    adapter_fault = residue_fault(ParkResult(residue=dict(adapter)), limit)
    if adapter_fault:
        what.append(f"the tenant's adapters report: {adapter_fault}")
    res.fault = (f"snapshot of job {job_id!r} via {backend} left {res.counted / 2**20:.1f} MiB on the device "
                 f"(limit {limit / 2**20:.1f} MiB, --residue-max-bytes / {RESIDUE_ENV}): {'; '.join(what)}. The next "
                 "tenant would not fit: free or track what stayed, then snapshot the job again")
    return res


__all__ = ["Residue", "measure", "merge", "residue_max"]
