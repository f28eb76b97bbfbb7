"""A job of a previous life (its orchestrator restarted or failed over) that keeps calling is alive.

Its session must re-attach within the TTL; until it does, its calls (acquire, release) are
proof of life too. The chaos test caught the engine granting such a job a turn and evicting
it 7 ms later, "did not re-attach within TTL", because the TTL counted from the
orchestrator's start: the next waiter's turn then overlapped the live holder's.
"""

from __future__ import annotations

import asyncio
import os

from rota.orchestrator import GroupState, Orchestrator, OrchestratorConfig
from rota.types import TurnRequest

TTL = 1.0


class KeptStore:
    """Keeps what was committed, as etcd does; ``copy()`` is what a successor loads after a crash."""

    def __init__(self, groups: dict[str, dict] | None = None) -> None:
        self.groups = dict(groups or {})

    async def load_all(self) -> dict[str, GroupState]:
        return {g: GroupState.from_dict(d) for g, d in self.groups.items()}

    async def commit(self, state: GroupState) -> None:
        self.groups[state.group_id] = state.to_dict()

    async def delete(self, group_id: str) -> None:
        self.groups.pop(group_id, None)

    def copy(self) -> KeptStore:
        return KeptStore(self.groups)


def test_a_job_that_calls_gets_its_ttl_to_re_attach_from_its_last_call() -> None:
    async def body() -> None:
        store = KeptStore()
        first = Orchestrator(OrchestratorConfig(ttl_s=TTL), store)
        await first.start()
        await first.attach("j", "g", 0, os.getpid(), 0)
        grant = await first.acquire(TurnRequest("j", "g"))
        crashed = store.copy()  # the first orchestrator dies here, with j holding g
        await first.stop()

        second = Orchestrator(OrchestratorConfig(ttl_s=TTL), crashed)
        await second.start()
        try:
            assert not second.job_alive("g", "j")  # no session and no call yet
            await asyncio.sleep(0.7 * TTL)
            await second.release("j", "g", grant.token)
            again = await second.acquire(TurnRequest("j", "g"))  # alive: it calls
            assert second.job_alive("g", "j")
            await asyncio.sleep(0.7 * TTL)  # past the TTL since the start, within it since the call
            assert second.groups["g"].holder == "j" and second.groups["g"].token == again.token
            await asyncio.sleep(0.8 * TTL)  # no session and no call for over a TTL: evicted
            assert second.groups["g"].holder == ""
        finally:
            await second.stop()

    asyncio.run(asyncio.wait_for(body(), 30))
