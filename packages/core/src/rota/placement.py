"""Which device of a multi-device group a turn goes to, and whom it parks there. Pure.

The orchestrator calls :func:`place` when a job that named several devices asks for a
turn, with a :class:`DeviceView` of each device it may use (see :mod:`rota.devices`):

1. a job whose state is still resident on a device goes there, when that device is free;
2. otherwise to a free device where its footprint fits without parking anyone, the one with
   the least room left (best fit: three 60 GB trainers and three 15 GB samplers fit on two
   130 GB devices only as two trainers on one); a job resident on a busy device *moves*
   there, device to device (a peer copy costs far less than waiting a whole turn);
3. otherwise a resident job waits for its own device;
4. otherwise (parked or new) to a device where it fits without parking, busy or not
   (shortest queue first);
5. otherwise to the device where parking costs least (:func:`evict_plan`), free first.

:func:`evict_plan` chooses whom a switch parks on one device: the set of residents whose
parking costs least and frees enough, where a resident that waits for a turn costs twice
its bytes (parked now, restored for its next turn) and an idle one once.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = ["Choice", "DeviceView", "evict_plan", "park_cost", "place"]

_EXACT_UP_TO = 12  # residents of one device searched exhaustively for the cheapest set (2**12 subsets)


@dataclass(frozen=True)
class DeviceView:
    """One device as the orchestrator sees it when it places a turn."""

    device: str
    busy: bool = False  # held, switching, or jobs queued for it
    queue: int = 0  # jobs queued for it
    residents: Mapping[str, int] = field(default_factory=dict)  # job -> device bytes it occupies there
    capacity: int = 0  # device bytes (0 = unknown: only an empty device fits anything)
    residue: int = 0  # bytes left there that parking cannot free (leaks, a state moving away)
    holder: str = ""  # never parked

    def used(self) -> int:
        return sum(self.residents.values()) + self.residue

    def fits(self, need: int) -> bool:
        """``need`` more bytes fit without parking anyone."""
        if not self.residents and not self.residue:
            return True
        return self.capacity > 0 and need > 0 and self.used() + need <= self.capacity


@dataclass(frozen=True)
class Choice:
    """Where the turn goes; ``move_from``: the device its resident state leaves (peer copy)."""

    device: str
    reason: str
    move_from: str = ""
    evict: tuple[str, ...] = ()  # residents parking would take there (at the time of placing)


def park_cost(job: str, nbytes: int, waiting: frozenset[str] | set[str]) -> int:
    """Bytes moved because ``job`` is parked: out now, and back for its next turn if it waits for one."""
    return nbytes * (2 if job in waiting else 1)


def evict_plan(residents: Mapping[str, int], need: int, capacity: int, *, residue: int = 0,
               waiting: frozenset[str] | set[str] = frozenset(), keep: frozenset[str] | set[str] = frozenset()
               ) -> list[str] | None:
    """The cheapest set of ``residents`` (job -> bytes) to park so that ``need`` fits; None if none does.

    ``keep``: never parked (the holder). With ``capacity`` 0 (unknown) every resident that
    holds bytes is parked. Ties go to fewer bytes moved, then to the order of ``residents``.
    """
    movable = {j: n for j, n in residents.items() if j not in keep}
    if capacity <= 0:
        return [j for j, n in movable.items() if n > 0]
    over = sum(residents.values()) + residue + need - capacity
    if over <= 0:
        return []
    if sum(movable.values()) < over:
        return None
    jobs = list(movable)
    if len(jobs) <= _EXACT_UP_TO:
        best: tuple[int, int, int, tuple[str, ...]] | None = None
        for k in range(1, len(jobs) + 1):
            for combo in itertools.combinations(jobs, k):
                freed = sum(movable[j] for j in combo)
                if freed < over:
                    continue
                cost = sum(park_cost(j, movable[j], waiting) for j in combo)
                key = (cost, freed, k, combo)
                if best is None or key[:3] < best[:3]:
                    best = key
        return list(best[3]) if best else None
    out, freed = [], 0  # many residents: cheapest per byte first
    for j in sorted(jobs, key=lambda j: (park_cost(j, 1, waiting), -movable[j])):
        if freed >= over:
            break
        out.append(j)
        freed += movable[j]
    return out


def place(job: str, need: int, views: list[DeviceView], *, home: str = "",
          waiting: frozenset[str] | set[str] = frozenset()) -> Choice:
    """Where ``job`` (``need`` bytes; 0 = unknown) takes its next turn, among ``views`` (non-empty).

    ``home``: the device its state is resident on ("" if parked or new). ``waiting``: jobs
    queued anywhere in the group (their next turns need their state).
    """
    if not views:
        raise ValueError("place() needs at least one device")
    by_dev = {v.device: v for v in views}
    here = by_dev.get(home)
    if here is not None and not here.busy:
        return Choice(home, "resident")
    free_fit = [v for v in views if not v.busy and v.device != home and v.fits(need)]
    if free_fit:  # best fit: the least room left, so big states still find a device with room for them
        best = min(free_fit, key=lambda v: (v.capacity - v.used() if v.capacity else 0, views.index(v)))
        return Choice(best.device, "moved: its device is busy, this one is free" if here is not None
                      else "fits on a free device", move_from=home if here is not None else "")
    if here is not None:
        return Choice(home, "resident: waits for its device")
    fit = [v for v in views if v.fits(need)]
    if fit:
        best = min(fit, key=lambda v: (v.busy, v.queue, views.index(v)))
        return Choice(best.device, "fits without parking")
    costed = []
    for v in views:
        plan = evict_plan(v.residents, need, v.capacity, residue=v.residue, waiting=waiting,
                          keep={v.holder} if v.holder else set())
        if plan is None:
            continue
        cost = sum(park_cost(j, v.residents[j], waiting) for j in plan)
        costed.append(((cost, v.busy, v.queue, views.index(v)), v, plan))
    if not costed:  # nothing frees enough anywhere (a holder too big): the shortest queue
        best = min(views, key=lambda v: (v.busy, v.queue, views.index(v)))
        return Choice(best.device, "does not fit anywhere: shortest queue")
    _, best, plan = min(costed, key=lambda c: c[0])
    return Choice(best.device, "parking costs least here", evict=tuple(plan))
