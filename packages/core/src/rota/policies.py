"""Scheduling policies: which waiter gets a group next, and how long a turn may last.

A policy is any object with ``choose(queue, tenants, now) -> Waiter`` and a
``max_turn_s`` attribute (0 = unlimited). Policies are plugins: this module registers
the built-in ones through :func:`rota_register_policies`, exactly as a third-party
distribution would. Orchestrators look them up by name with :func:`make_policy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rota.errors import InvalidArgument
from rota.hookspecs import hookimpl

if TYPE_CHECKING:
    import pluggy

    from rota._state import TenantRecord, Waiter


class Policy(Protocol):
    """Chooses the next holder among waiters."""

    name: str
    max_turn_s: float

    def choose(self, queue: list[Waiter], tenants: dict[str, TenantRecord], now: float) -> Waiter:
        """Return one element of the non-empty ``queue``."""


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
