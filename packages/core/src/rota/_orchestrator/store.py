"""Where group state lives: the :class:`GroupStore` protocol and the in-process :class:`MemoryStore`."""

from __future__ import annotations

from typing import Protocol

from rota._orchestrator.state import GroupState


class GroupStore(Protocol):
    """Where group state lives. Implementations: :class:`MemoryStore`, rota_etcd's.

    A store may offer ``delete(group_id)``: groups idle for ``idle_group_ttl_s`` are then
    forgotten there too. (An orchestrator of another kind than core's own, e.g. rota_etcd's
    HA replica, comes from the ``rota_orchestrator`` hook, not from its store.)
    """

    async def load_all(self) -> dict[str, GroupState]:
        """Every stored group (called once when the orchestrator starts)."""

    async def commit(self, state: GroupState) -> None:
        """Persist ``state``; raise :class:`rota.errors.Unavailable` if it cannot be
        made durable (then the transition must not take effect)."""


class MemoryStore:
    """State in this process only: the embedded single-host orchestrator."""

    async def load_all(self) -> dict[str, GroupState]:
        return {}

    async def commit(self, state: GroupState) -> None:
        return None

    async def delete(self, group_id: str) -> None:
        return None


__all__ = ["GroupStore", "MemoryStore"]
