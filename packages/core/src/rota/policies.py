"""Scheduling policies: which waiter gets a group next, and how long a turn may last.

A policy is any object with ``choose(queue, tenants, now) -> Waiter`` and a
``max_turn_s`` attribute (0 = unlimited) (:class:`Policy`); it sees the queue as
:class:`Waiter` and the group's jobs as :class:`TenantRecord` (both public, also in
:mod:`rota.types`). Policies are plugins: this module registers the built-in ones
through :func:`rota_register_policies`, exactly as a third-party distribution would.
:func:`available_policies` lists every installed one by name (``rota orchestrator
serve --policy`` and ``rota k8s`` values check against it); :func:`make_policy` builds one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rota.errors import InvalidArgument
from rota.hookspecs import hookimpl
from rota.types import TenantRecord, Waiter

if TYPE_CHECKING:
    import pluggy

__all__ = ["FairShare", "Fifo", "Policy", "Priority", "ResidentFirst", "TenantRecord", "Waiter", "available_policies",
           "make_policy", "rota_register_policies"]


class Policy(Protocol):
    """Chooses the next holder among waiters."""

    name: str
    max_turn_s: float

    def choose(self, queue: list[Waiter], tenants: dict[str, TenantRecord], now: float) -> Waiter | None:
        """Return one element of the non-empty ``queue``, or None to grant nobody yet.

        A policy that may answer None sets ``recheck_s``: the orchestrator asks again
        that often (and at every enqueue and release) until it names a waiter.
        """


@dataclass
class Fifo:
    """First come, first served (the v1alpha1 contract)."""

    max_turn_s: float = 0.0
    name: str = "fifo"

    def choose(self, queue: list[Waiter], tenants: dict[str, TenantRecord], now: float) -> Waiter:
        return min(queue, key=lambda w: w.seq)


@dataclass
class Priority:
    """Highest ``priority`` first; FIFO among equals."""

    max_turn_s: float = 0.0
    name: str = "priority"

    def choose(self, queue: list[Waiter], tenants: dict[str, TenantRecord], now: float) -> Waiter:
        return min(queue, key=lambda w: (-w.priority, w.seq))


@dataclass
class FairShare:
    """Least GPU time per unit of weight first (weighted fair share); FIFO among equals."""

    max_turn_s: float = 0.0
    name: str = "fair"

    def choose(self, queue: list[Waiter], tenants: dict[str, TenantRecord], now: float) -> Waiter:
        def used(w: Waiter) -> float:
            rec = tenants.get(w.job_id)
            return (rec.gpu_seconds if rec else 0.0) / max(w.weight, 1e-9)

        return min(queue, key=lambda w: (used(w), w.seq))


@dataclass
class ResidentFirst:
    """Wraps a policy: waiters whose state is on the device go before parked ones.

    Granting a parked job that does not fit beside the residents costs a switch (park
    someone, restore it); when the device holds fewer jobs than take turns, alternating
    among them parks at every turn. This serves the resident waiters, and parked ones
    that fit beside the residents in ``capacity_bytes`` (they cost only a restore), by
    ``base``; another parked waiter gets in only when none of those waits and it has
    waited ``patience_s`` (or no other job is on the device): a job that does not fit
    waits for room instead of trading places at every turn. ``patience_s`` bounds how
    long a parked job can be passed over. Use the orchestrator's own ``--capacity``.

    Priorities decide who stays: a parked waiter that fits once residents of lower
    priority are parked is served like a resident (the switch parks those, lowest
    priority first), so high-priority jobs end up resident together and low-priority
    ones wait for room.

    Waiting for room is worth it only while the residents use the device. Once none of them
    has held, asked for or given back a turn for as long as letting the parked waiter in would
    cost (its restore, and the parks and later restores of what makes room for it, at the
    switch rate the group's parks measured, else ``switch_bytes_per_s``), the device is idle
    and the waiter gets in: a rent-or-buy rule that wastes at most that cost twice. (A resident
    waiting on the parked job itself, e.g. a trainer on its own evaluation engine, left the
    device idle for all of ``patience_s`` before.) Without footprints that cost is unknown and
    the waiter waits for its patience, as before.
    """

    base: Policy
    patience_s: float = 30.0
    capacity_bytes: int = 0  # the device's size, as the orchestrator's; 0: every parked job needs a switch
    switch_bytes_per_s: float = 25e9  # a switch's rate until the group's own parks have measured one
    recheck_s = 0.25  # while it holds a parked waiter back, the orchestrator asks again this often

    @property
    def name(self) -> str:
        return f"{self.base.name}+resident-first"

    @property
    def max_turn_s(self) -> float:
        return self.base.max_turn_s

    def choose(self, queue: list[Waiter], tenants: dict[str, TenantRecord], now: float) -> Waiter | None:
        """A resident waiter by ``base``; else a parked one that is due; else None (nobody yet)."""
        def resident(job: str) -> bool:
            rec = tenants.get(job)
            return rec is not None and rec.state in ("resident", "holding")

        held = sum(rec.footprint_bytes for rec in tenants.values() if resident(rec.job_id))

        def cheap(job: str) -> bool:  # on the device, or fits beside what is: no park needed
            rec = tenants.get(job)
            return resident(job) or (rec is not None and rec.footprint_bytes > 0 and self.capacity_bytes > 0
                                     and held + rec.footprint_bytes <= self.capacity_bytes)

        def outranks(w: Waiter) -> bool:  # fits once lower-priority residents are parked
            rec = tenants.get(w.job_id)
            if rec is None or rec.footprint_bytes <= 0 or self.capacity_bytes <= 0:
                return False
            lower = sum(r.footprint_bytes for r in tenants.values() if resident(r.job_id) and r.priority < w.priority)
            return lower > 0 and held - lower + rec.footprint_bytes <= self.capacity_bytes

        on_device = [w for w in queue if cheap(w.job_id) or outranks(w)]
        if on_device:
            return self.base.choose(on_device, tenants, now)
        residents = [rec for rec in tenants.values() if resident(rec.job_id)]
        if not residents:  # nothing to wait for: the device is free
            return self.base.choose(queue, tenants, now)
        # how long the residents have left the device idle (none while one holds it), and what a switch moves a second
        holding = any(r.state == "holding" for r in residents)
        quiet_s = 0.0 if holding else now - max(r.last_active for r in residents)
        rate = switch_rate(tenants, self.switch_bytes_per_s) if quiet_s >= self.recheck_s else None
        due = [w for w in queue if now - w.arrived >= self.patience_s
               or (rate is not None and self._worth_it(tenants.get(w.job_id), held, quiet_s, rate))]
        return self.base.choose(due, tenants, now) if due else None

    def _worth_it(self, rec: TenantRecord | None, held: int, quiet_s: float, rate: float) -> bool:
        """The device has been idle for at least what letting this parked waiter in would cost."""
        if rec is None or rec.footprint_bytes <= 0:
            return False
        room = held if self.capacity_bytes <= 0 else max(0, held + rec.footprint_bytes - self.capacity_bytes)
        return quiet_s >= (rec.footprint_bytes + 2 * room) / rate


def switch_rate(tenants: dict[str, TenantRecord], default: float) -> float:
    """Bytes a second the group's parks moved (the median over jobs of their last park), else ``default``."""
    rates = sorted(rec.parked_bytes / (rec.parks_ms[-1] / 1000.0) for rec in tenants.values()
                   if rec.parked_bytes > 0 and rec.parks_ms and rec.parks_ms[-1] > 0)
    return rates[len(rates) // 2] if rates else default


@hookimpl
def rota_register_policies(register: Callable[[str, Callable[..., Any]], None]) -> None:
    register("fifo", Fifo)
    register("priority", Priority)
    register("fair", FairShare)


def available_policies(pm: pluggy.PluginManager) -> dict[str, Callable[..., Any]]:
    """Every policy factory registered by any plugin, by name."""
    found: dict[str, Callable[..., Any]] = {}
    pm.hook.rota_register_policies(register=found.__setitem__)
    return found


def make_policy(pm: pluggy.PluginManager, name: str, *, max_turn_s: float = 0.0) -> Policy:
    """Build the policy ``name`` with a maximum turn length (0 = unlimited)."""
    factories = available_policies(pm)
    if name not in factories:
        raise InvalidArgument(f"unknown policy {name!r}; choose one of {', '.join(sorted(factories))}")
    if max_turn_s < 0:
        raise InvalidArgument(f"max turn {max_turn_s!r} s is negative; use 0 for unlimited or a positive number")
    return factories[name](max_turn_s=max_turn_s)
