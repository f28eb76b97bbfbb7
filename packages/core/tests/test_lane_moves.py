"""A grant in a lane waits for a state still moving out of its device, and comes once the move is over.

Through the orchestrator itself (in process, callers without sessions): x (6,000 bytes) is resident
on fake:0 while h holds it, and w (4,500) waits there, fitting only by parking x; x's next turn
then moves to fake:1, and x's 6,000 bytes count on fake:0 until that turn ends. When h leaves
fake:0, granting w would hold 10,500 bytes there against a 10,000-byte device: w waits instead,
and is granted as soon as x's move ends (or x leaves without it), never left waiting.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from rota.orchestrator import Orchestrator, OrchestratorConfig
from rota.types import Grant, TurnRequest

BOTH = ["fake:0", "fake:1"]


def _ask(engine: Orchestrator, job: str, nbytes: int, devices: list[str]) -> asyncio.Task:
    return asyncio.create_task(engine.acquire(TurnRequest(job, "g", footprint_bytes=nbytes, devices=devices)))


async def _setup(engine: Orchestrator, w_asks: str) -> tuple[Grant, Grant, asyncio.Task]:
    """x moved to fake:1 and holds it; h released fake:0; w asked for fake:0 (``w_asks`` "queued": behind h,
    "later": after h released). Returns (x's grant, h's grant, w's acquire)."""
    grant = await engine.acquire(TurnRequest("x", "g", footprint_bytes=6000, devices=BOTH))
    assert grant.device == "fake:0"
    await engine.release("x", "g", grant.token)
    h = await engine.acquire(TurnRequest("h", "g", footprint_bytes=2000, devices=["fake:0"]))  # room beside x
    w = _ask(engine, "w", 4500, ["fake:0"]) if w_asks == "queued" else None
    await asyncio.sleep(0.05)
    x = await engine.acquire(TurnRequest("x", "g", footprint_bytes=6000, devices=BOTH))
    assert x.device == "fake:1"  # its device is busy, fake:1 free: it moves
    await engine.release("h", "g", h.token)
    w = w or _ask(engine, "w", 4500, ["fake:0"])
    await asyncio.sleep(0.3)
    lane = engine.groups["g@fake:0"]
    assert not w.done() and lane.holder == "" and lane.queued("w"), "w granted over x's bytes still on fake:0"
    return x, h, w


async def _x_resident_h_and_y_holding(engine: Orchestrator) -> tuple[Grant, Grant]:
    """x (6,000) resident on fake:0, h (2,000) holding fake:0 beside it, y (5,000) holding fake:1: (h's, y's)
    grants."""
    grant = await engine.acquire(TurnRequest("x", "g", footprint_bytes=6000, devices=["fake:0"]))
    await engine.release("x", "g", grant.token)
    h = await engine.acquire(TurnRequest("h", "g", footprint_bytes=2000, devices=["fake:0"]))
    y = await engine.acquire(TurnRequest("y", "g", footprint_bytes=5000, devices=["fake:1"]))
    return h, y


@pytest.mark.parametrize("w_asks", ["queued", "later"])
def test_a_grant_waits_for_a_state_moving_out_and_comes_when_it_has_moved(w_asks: str) -> None:
    async def body() -> None:
        engine = Orchestrator(OrchestratorConfig(capacity_bytes=10_000))
        await engine.start()
        try:
            x, _, w = await _setup(engine, w_asks)
            await engine.release("x", "g", x.token)  # its move is over: fake:0 has room for w beside h
            grant = await asyncio.wait_for(w, 5)
            lane = engine.groups["g@fake:0"]
            assert grant.device == "fake:0" and sorted(lane.residents) == ["h", "w"]
            assert lane.residue_off("") == 0
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(body(), 20))


@pytest.mark.parametrize("leaves", ["evicted", "lost", "abandoned", "faulted"])
def test_a_grant_waiting_for_a_move_comes_when_the_mover_leaves_without_it(leaves: str) -> None:
    """x's turn on fake:1 ends without its move (the scheduler evicts it, it dies, its grant is abandoned, one of
    its ranks faults it): nothing will clear its bytes on fake:0 by a move any more, so w is granted there at
    once, as beside any residue."""
    async def body() -> None:
        engine = Orchestrator(OrchestratorConfig(capacity_bytes=10_000))
        await engine.start()
        try:
            rank = await engine.attach("x", "g", 0, os.getpid(), 0) if leaves == "faulted" else None
            x, _, w = await _setup(engine, "queued")
            if leaves == "abandoned":
                await engine.abandon("x", "g", x.token)
            elif rank is not None:  # a failed restore or an error in its turn, as its client reports it
                await engine.fault_rank(rank, "test")
            else:
                await engine.evict("x", "g", reason="test", lost=leaves == "lost")
            grant = await asyncio.wait_for(w, 5)
            assert grant.device == "fake:0" and engine.groups["g@fake:0"].holder == "w"
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_grant_waiting_for_a_move_comes_when_the_mover_stops_waiting_for_its_turn() -> None:
    """x's next turn is placed on fake:1 (its state on fake:0 counts there until the move), where it waits behind
    y; w waits on fake:0 for that move. x's caller gives up (a caller without a session: it leaves the queue):
    the move will not happen, so w is granted on fake:0 at once, as beside any residue."""
    async def body() -> None:
        engine = Orchestrator(OrchestratorConfig(capacity_bytes=10_000))
        await engine.start()
        try:
            h, y = await _x_resident_h_and_y_holding(engine)
            w = _ask(engine, "w", 4500, ["fake:0"])
            x = _ask(engine, "x", 6000, ["fake:1"])  # behind y: 5,000 + 6,000 do not fit beside each other
            await asyncio.sleep(0.1)
            assert engine.groups["g@fake:1"].queued("x") and engine.groups["g@fake:0"].residue_off("") == 6000
            await engine.release("h", "g", h.token)
            await asyncio.sleep(0.3)
            assert not w.done() and engine.groups["g@fake:0"].holder == "", "w granted over x's bytes on fake:0"
            x.cancel()
            grant = await asyncio.wait_for(w, 5)
            assert grant.device == "fake:0" and engine.groups["g@fake:0"].holder == "w"
            assert engine.groups["g@fake:1"].holder == "y" and not engine.groups["g@fake:1"].queued("x")
            await engine.release("y", "g", y.token)
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(body(), 20))


def test_a_grant_waiting_for_a_move_is_taken_by_a_device_that_falls_idle() -> None:
    """w waits on fake:0 for x's state to move out (x waits behind y on fake:1), so fake:0 has no holder; when
    fake:2 falls idle with room for w, w moves there at once rather than waiting for y's and x's turns."""
    async def body() -> None:
        engine = Orchestrator(OrchestratorConfig(capacity_bytes=10_000))
        await engine.start()
        try:
            h, y = await _x_resident_h_and_y_holding(engine)
            z = await engine.acquire(TurnRequest("z", "g", footprint_bytes=6000, devices=["fake:2"]))
            x = _ask(engine, "x", 6000, ["fake:1"])  # behind y; its 6,000 bytes count on fake:0 until it moves
            await asyncio.sleep(0.05)
            w = _ask(engine, "w", 4500, ["fake:0", "fake:2"])  # fits neither beside its holder: the first queue
            await asyncio.sleep(0.1)
            assert engine.groups["g@fake:0"].queued("w"), "w was meant to wait on fake:0"
            await engine.release("h", "g", h.token)
            await asyncio.sleep(0.3)
            assert not w.done() and engine.groups["g@fake:0"].holder == "", "w granted over x's bytes on fake:0"
            await engine.release("z", "g", z.token, footprint_bytes=1000)  # fake:2 idle, room for w beside z
            grant = await asyncio.wait_for(w, 5)
            assert grant.device == "fake:2" and engine.groups["g@fake:2"].holder == "w"
            assert not engine.groups["g@fake:0"].queued("w") and engine.groups["g@fake:1"].queued("x")
            await engine.release("w", "g", grant.token)
            await engine.release("y", "g", y.token)
            await engine.release("x", "g", (await asyncio.wait_for(x, 5)).token)
        finally:
            await engine.stop()

    asyncio.run(asyncio.wait_for(body(), 20))
