"""A group over several devices with its state in a real etcd: each device's lane is committed with its own
holder and turn lease, lanes are led with their group's shard, and a new term finds a job's state where it was."""

from __future__ import annotations

import asyncio

from etcd_testlib import run
from test_etcd_store import leading_term

from rota.orchestrator import OrchestratorConfig
from rota.types import TurnRequest
from rota_etcd._replica import EtcdOrchestrator
from rota_etcd._shards import shard_of
from rota_etcd._store import EtcdStore

DEVICES = ("fake:0", "fake:1")


def test_lanes_are_in_their_groups_shard() -> None:
    assert {shard_of(f"g{i}@fake:{d}", 16) == shard_of(f"g{i}", 16) for i in range(50) for d in (0, 1)} == {True}


def test_two_holders_on_two_lanes_committed_and_found_again_by_the_next_term(etcd, prefix) -> None:
    async def body() -> None:
        store = EtcdStore(etcd.url, prefix=prefix)
        orch = None
        try:
            ts = await leading_term(store, 5)
            orch = EtcdOrchestrator(OrchestratorConfig(capacity_bytes=10_000), ts, name="test")
            await orch.start()
            ga = await orch.acquire(TurnRequest("a", "g", footprint_bytes=3000, devices=DEVICES))
            gb = await asyncio.wait_for(orch.acquire(TurnRequest("b", "g", footprint_bytes=3000, devices=DEVICES)),
                                        5)  # a holds fake:0: b gets fake:1 at once
            assert (ga.device, gb.device, ga.group_id, gb.group_id) == ("fake:0", "fake:1", "g", "g")
            snap = await store.read()
            assert (snap.groups["g@fake:0"].holder, snap.groups["g@fake:1"].holder) == ("a", "b")
            assert snap.turns["g@fake:0"].token == ga.token and snap.turns["g@fake:1"].token == gb.token
            await orch.release("a", "g", ga.token)
            await orch.release("b", "g", gb.token)
            await orch.stop()
            orch = None
            ts = await leading_term(store, 5)  # the next term loads the lanes from etcd
            orch = EtcdOrchestrator(OrchestratorConfig(capacity_bytes=10_000), ts, name="next")
            await orch.start()
            again = await orch.acquire(TurnRequest("b", "g", footprint_bytes=3000, devices=DEVICES))
            assert again.device == "fake:1" and again.token > gb.token  # resident there: back to its device
            await orch.release("b", "g", again.token)
        finally:
            if orch is not None:
                await orch.stop()
            await store.close()

    run(body())
