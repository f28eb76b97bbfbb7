"""Value types that cross rota's public API: grants, release results, park plans."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Grant:
    """Proof that a job holds a group, returned by ``acquire``.

    ``token`` is the fencing token: it grows with every grant of the group and a
    release or park carrying an older one is refused. ``device``: the device of this
    turn when the job named several (``TurnRequest.devices``), else "".
    """

    job_id: str
    group_id: str
    token: int
    waited_ms: int = 0
    context_restored: bool = False
    ttl_ms: int = 0
    max_turn_ms: int = 0
    device: str = ""


@dataclass(frozen=True)
class ReleaseInfo:
    """What ``release`` did: who still waits and whether parking was deferred."""

    pending_waiters: int
    snapshot_deferred: bool
    group_released: bool = True


class ParkMode(str, enum.Enum):
    """How parked state is kept: copied to host (OFFLOAD) or dropped (DISCARD)."""

    OFFLOAD = "offload"
    DISCARD = "discard"


@dataclass(frozen=True)
class ParkPlan:
    """Which tags to park or restore, and how. Empty ``tags`` means every tag.

    ``discard`` names tags that may be dropped instead of copied (e.g. gradients
    that are zeroed before the next step anyway). ``device`` (restore only): where the
    state goes, when the turn was granted on a device other than the one it was parked
    from or still sits on ("" = where it was); a resident state moves device to device.
    """

    tags: frozenset[str] = frozenset()
    mode: ParkMode = ParkMode.OFFLOAD
    discard: frozenset[str] = frozenset()
    token: int = 0
    device: str = ""

    def wants(self, tag: str) -> bool:
        """True if ``tag`` is covered by this plan."""
        return not self.tags or tag in self.tags


@dataclass
class ParkResult:
    """Bytes an adapter moved for one park or restore, and how long it took.

    ``residue`` (park): device bytes left behind, by tag or category (``untracked:NAME``,
    ``process:allocated``...); ``process:`` readings are the whole process's, and when several
    adapters park one tenant the last one's (taken after every earlier part freed its state) counts.
    ``discarded`` (park and restore): tags dropped, not
    restored; ``recreated`` (restore): discarded tags the adapter rebuilt.
    ``host_bytes``: the host pool behind it; ``spilled_bytes``: the part of it in a
    spill file instead of pinned memory. ``verify_seconds``: spent on fingerprints.
    """

    bytes_moved: int = 0
    seconds: float = 0.0
    by_tag: dict[str, int] = field(default_factory=dict)
    residue: dict[str, int] = field(default_factory=dict)
    discarded: list[str] = field(default_factory=list)
    recreated: list[str] = field(default_factory=list)
    host_bytes: int = 0
    spilled_bytes: int = 0
    verify_seconds: float = 0.0


@dataclass(frozen=True)
class TurnRequest:
    """Everything the orchestrator needs to queue a job for a group."""

    job_id: str
    group_id: str
    priority: int = 0
    weight: float = 1.0
    world_size: int = 1
    rank: int = 0
    footprint_bytes: int = 0
    devices: tuple[str, ...] = ()  # devices of this host the job may run on (see rota.devices)
    quiet: bool = False  # no prefetch in the group while this turn is held (see Gpu.turn)


@dataclass(frozen=True)
class ReleaseRequest:
    """Everything the orchestrator needs to end a turn: the grant, and what this rank reports with it.

    ``footprint_bytes``: device bytes the turn needed (0 = unchanged); ``restore_seconds``: this rank's
    restore at the turn's start (0 = none), for the orchestrator's restore histogram.
    """

    grant: Grant
    rank: int = 0
    footprint_bytes: int = 0
    restore_seconds: float = 0.0


@dataclass(frozen=True)
class Placement:
    """Where a scheduler plugin placed a tenant (a Slurm GRES string, a K8s claim...)."""

    scheduler: str
    group_id: str
    details: dict[str, str] = field(default_factory=dict)
