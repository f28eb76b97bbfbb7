"""What a park left on the device, and when that is a fault.

Adapters and the agent report residue as ``name -> bytes`` in :class:`~rota.types.ParkResult`;
these functions count it the same way everywhere (torch-free, so the agent can use them).
"""

from __future__ import annotations

from collections.abc import Mapping

from rota._types import ParkResult
from rota._units import env_bytes
from rota.errors import PermanentError

DEFAULT_RESIDUE_MAX_BYTES = 256 << 20  # what a park may leave behind unless ROTA_RESIDUE_MAX_BYTES says otherwise
RESIDUE_ENV = "ROTA_RESIDUE_MAX_BYTES"

__all__ = ["DEFAULT_RESIDUE_MAX_BYTES", "RESIDUE_ENV", "ResidueError", "attributed_residue", "residue_counted",
           "residue_fault", "residue_left", "residue_max_bytes"]


class ResidueError(PermanentError):
    """A park left more on the device than ``ROTA_RESIDUE_MAX_BYTES`` allows (the state is parked)."""


def attributed_residue(residue: Mapping[str, int]) -> dict[str, int]:
    """The residue adapters name (tracked tags, ``untracked:...``), without the allocator's ``process:`` totals."""
    return {k: v for k, v in residue.items() if not k.startswith("process:") and v > 0}


def residue_counted(residue: Mapping[str, int]) -> int:
    """What the residue limit counts: the named bytes, or the allocator's ``process:allocated`` if more."""
    return max(sum(attributed_residue(residue).values()), residue.get("process:allocated", 0))


def residue_left(result: ParkResult) -> int:
    """Device bytes a park left behind: what adapters attribute, or what the allocator still holds if more."""
    held = result.residue.get("process:reserved", result.residue.get("process:allocated", 0))
    return max(sum(attributed_residue(result.residue).values()), held)


def residue_fault(result: ParkResult, limit: int) -> str:
    """A message naming what stayed on the device, or "" when the residue is within ``limit``.

    The residue counted is the larger of what adapters attribute (tracked tags still
    held, ``untracked:...`` tensors) and the allocator's total (``process:allocated``).
    """
    named = attributed_residue(result.residue)
    left = residue_counted(result.residue)
    if limit <= 0 or left <= limit:
        return ""
    what = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sorted(named.items(), key=lambda kv: -kv[1])[:8])
    alloc = result.residue.get("process:allocated")
    if alloc is not None:
        what += f"{'; ' if what else ''}allocator: {alloc / 2**20:.1f} MiB allocated, " \
                f"{result.residue.get('process:reserved', 0) / 2**20:.1f} MiB reserved"
    outside = result.residue.get("process:outside_allocator")
    if outside is not None:  # CUDA context, NCCL, library handles: reported, never counted
        growth = result.residue.get("process:outside_allocator_growth")
        what += f"; outside torch's allocator (not counted): {outside / 2**20:.1f} MiB" + \
                (f", {growth / 2**20:.1f} MiB of it since the tenant was tracked (NCCL, handles)"
                 if growth is not None else "")
    return (f"park left {left / 2**20:.1f} MiB on the device (limit {limit / 2**20:.1f} MiB, "
            f"ROTA_RESIDUE_MAX_BYTES): {what or 'unattributed'}; track or free it (e.g. register it as a buffer or "
            "delete it before the turn ends)")


def residue_max_bytes() -> int:
    """The limit from ``ROTA_RESIDUE_MAX_BYTES`` (a size; default 256 MiB; 0 disables the check)."""
    return env_bytes(RESIDUE_ENV, DEFAULT_RESIDUE_MAX_BYTES)
