"""app_endpoint's shared call slots are handed out by owner, fewest in flight first (FairSlots)."""

from __future__ import annotations

import asyncio

from rota_agent.backends.app_endpoint import FairSlots


def test_a_freed_slot_goes_to_the_owner_with_the_fewest_calls():
    async def body() -> list[str]:
        slots = FairSlots(2)
        await slots.acquire("a")
        await slots.acquire("a")  # a holds both
        got: list[str] = []

        async def wait(owner: str) -> None:
            await slots.acquire(owner)
            got.append(owner)

        tasks = [asyncio.create_task(wait(o)) for o in ("a", "a", "b")]  # a queued twice before b
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(wait("c"))
        await asyncio.sleep(0)
        cancelled.cancel()  # a waiter that gives up takes nothing with it
        await asyncio.sleep(0)
        slots.release("a")  # a holds 1, b 0: b first, though it came last
        await asyncio.sleep(0)
        slots.release("a")  # a holds 0, b 1: a
        await asyncio.sleep(0)
        slots.release("b")  # a 1, b 0; only a waits
        await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert slots.free == 0 and dict(slots.held) == {"a": 2}
        for _ in range(2):
            slots.release("a")
        assert slots.free == 2 and not slots.held
        return got

    assert asyncio.run(body()) == ["b", "a", "a"]
