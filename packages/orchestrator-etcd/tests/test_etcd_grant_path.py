"""The grant path of the etcd-backed orch against a real etcd: how many transactions an acquire costs."""

from __future__ import annotations

import asyncio
from typing import Any

from etcd_testlib import run
from test_etcd_store import leading_term

from rota.orchestrator import OrchestratorConfig
from rota.types import TurnRequest
from rota_etcd._replica import EtcdOrchestrator
from rota_etcd._store import EtcdStore


def count_txns(client: Any) -> list[str]:
    """Record what every transaction ``client`` sends is for (the call still goes to etcd)."""
    sent: list[str] = []
    real = client.txn

    async def txn(*args: Any, **kwargs: Any) -> Any:
        sent.append(kwargs.get("what", "?"))
        return await real(*args, **kwargs)

    client.txn = txn
    return sent


async def revision(store: EtcdStore) -> int:
    assert store.client is not None
    return (await store.client.get(store.prefix.encode(), prefix=True)).header.revision


def test_a_tenant_alone_in_its_group_is_granted_in_one_transaction(etcd, prefix) -> None:
    async def body() -> None:
        store = EtcdStore(etcd.url, prefix=prefix)
        orch = None
        try:
            ts = await leading_term(store, 5)
            orch = EtcdOrchestrator(OrchestratorConfig(), ts, name="test")
            await orch.start()
            first = await orch.acquire(TurnRequest("a", "g"))  # creates the group
            await orch.release("a", "g", first.token)
            sent = count_txns(ts.client)
            for turn in range(3):
                before = await revision(store)
                grant = await orch.acquire(TurnRequest("a", "g"))
                assert (grant.token, sent) == (first.token + 1 + turn, ["the commit of group 'g'"])
                assert await revision(store) == before + 1  # the enqueue and the grant: one write
                snap = await store.read()
                assert (snap.groups["g"].holder, snap.turns["g"].token) == ("a", grant.token)
                await orch.release("a", "g", grant.token)
                sent.clear()
            # a group that is held: the waiter's enqueue is committed, and its grant after the release
            held = await orch.acquire(TurnRequest("a", "g"))
            waiting = asyncio.ensure_future(orch.acquire(TurnRequest("b", "g")))
            await asyncio.sleep(0.2)
            assert not waiting.done() and sent == ["the commit of group 'g'"] * 2
            await orch.release("a", "g", held.token)
            assert (await asyncio.wait_for(waiting, 5)).token == held.token + 1
            assert sent == ["the commit of group 'g'"] * 4  # acquire, enqueue, release, grant
        finally:
            if orch is not None:
                await orch.stop()
            await store.close()

    run(body())
