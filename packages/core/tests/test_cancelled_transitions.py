"""A transition finishes even when the RPC that asked for it is cancelled mid-commit.

With a store whose commit takes time (etcd), a gRPC handler may be cancelled while it
awaits the commit (its client died). The engine must still finish the transition:
otherwise a dead holder's eviction changes memory but never hands the group on.
"""

from __future__ import annotations

import asyncio

from rota._orchestrator.state import GroupState
from rota.orchestrator import Orchestrator, OrchestratorConfig
from rota.types import TurnRequest


class SlowStore:
    """Commits take 50 ms, like a remote store on a bad day."""

    def __init__(self) -> None:
        self.commits = 0

    async def load_all(self) -> dict[str, GroupState]:
        return {}

    async def commit(self, state: GroupState) -> None:
        await asyncio.sleep(0.05)
        self.commits += 1


def test_release_and_evict_cancelled_mid_commit_still_hand_the_group_on() -> None:
    async def body() -> None:
        engine = Orchestrator(OrchestratorConfig(), SlowStore())
        await engine.start()
        try:
            await engine.acquire(TurnRequest("a", "g"))
            waiter_b = asyncio.create_task(engine.acquire(TurnRequest("b", "g")))
            waiter_c = asyncio.create_task(engine.acquire(TurnRequest("c", "g")))
            await asyncio.sleep(0.3)

            release = asyncio.create_task(engine.release("a", "g", token=1))
            await asyncio.sleep(0.01)  # inside the commit
            release.cancel()
            grant_b = await asyncio.wait_for(waiter_b, 2)
            assert grant_b.token == 2

            evict = asyncio.create_task(engine.evict("b", "g", reason="test", lost=True))
            await asyncio.sleep(0.01)
            evict.cancel()
            grant_c = await asyncio.wait_for(waiter_c, 2)
            assert grant_c.token == 3
            (g,) = await engine.status("g")
            assert (g.holder, g.queue) == ("c", [])
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_an_acquire_cancelled_mid_commit_leaves_memory_and_store_agreeing() -> None:
    async def body() -> None:
        store = SlowStore()
        engine = Orchestrator(OrchestratorConfig(), store)
        await engine.start()
        try:
            await engine.acquire(TurnRequest("a", "g"))
            before = store.commits
            pending = asyncio.create_task(engine.acquire(TurnRequest("b", "g")))
            await asyncio.sleep(0.01)  # inside the enqueue's commit
            pending.cancel()
            await asyncio.sleep(0.3)
            (g,) = await engine.status("g")
            # the enqueue finished and was committed; the gone caller then left the queue (committed too)
            assert g.queue == [] and store.commits >= before + 2
            await engine.release("a", "g", token=1)
            await asyncio.sleep(0.2)
            (g,) = await engine.status("g")
            assert g.holder == ""  # nobody was granted on behalf of the caller that left
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(body(), 20))
