"""What the commit path saves per grant stays exact: cached tenant JSON, and one turn watch for every shard."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from aetcd import rpc
from etcd_testlib import run
from test_etcd_store import granted

from rota_etcd._shards import shard_of
from rota_etcd._store import EtcdStore, decode_state, encode_state
from rota_etcd._turnwatch import TurnWatch


def test_cached_tenant_json_is_what_encoding_afresh_writes_after_every_change(monkeypatch: pytest.MonkeyPatch) -> None:
    g = granted("g", "a", "b")
    # frozen clocks: each encoding turns monotonic times into wall-clock ones with the offset of its instant
    # (time.time() - time.monotonic(), two reads), and two instants' offsets can round to another 4th decimal;
    # it failed two clean-clone CI runs, once with only time.time tied to time.monotonic
    now, wall = time.monotonic(), time.time()
    monkeypatch.setattr(time, "monotonic", lambda: now)
    monkeypatch.setattr(time, "time", lambda: wall)
    cache: dict = {}
    assert encode_state(g, cache) == encode_state(g) and set(cache) == {"a", "b"}
    rec = g.tenants["a"]
    for x in range(40):  # the stored window of samples moves, also when the newest equals the one before
        rec.waits_ms.append(7.0 if x % 3 else 5.0)
        assert encode_state(g, cache) == encode_state(g)
    rec.footprint_bytes, rec.state = 123, "parked"
    g.tenants["b"].parks_ms.append(1.5)
    assert encode_state(g, cache) == encode_state(g)
    back = decode_state(encode_state(g, cache))
    assert (back.tenants["a"].footprint_bytes, list(back.tenants["a"].waits_ms)[-2:]) == (123, [7.0, 5.0])
    del g.tenants["b"]  # a collected tenant leaves the cache too
    assert encode_state(g, cache) == encode_state(g) and set(cache) == {"a"}


def test_a_clock_step_re_encodes_the_cached_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached tenant's JSON holds wall-clock times (its last activity): after the wall clock steps (NTP), it is
    encoded afresh, not kept with the old clock's times until the tenant next changes."""
    g = granted("g", "a", "b")
    now, wall = time.monotonic(), time.time()
    monkeypatch.setattr(time, "monotonic", lambda: now)
    monkeypatch.setattr(time, "time", lambda: wall)
    g.tenants["a"].last_active = now - 5
    cache: dict = {}
    before = json.loads(encode_state(g, cache))["tenants"]["a"]["last_active"]
    monkeypatch.setattr(time, "time", lambda: wall + 3600)  # the wall clock steps an hour; monotonic does not
    assert encode_state(g, cache) == encode_state(g)
    assert json.loads(encode_state(g, cache))["tenants"]["a"]["last_active"] == before + 3600


def groups_of_shards(count: int, shards: int) -> list[str]:
    """One group name per shard 0..count-1 (of ``shards``)."""
    names: dict[int, str] = {}
    for i in range(1000):
        names.setdefault(shard_of(f"g{i}", shards), f"g{i}")
    return [names[s] for s in range(count)]


def test_one_turn_watch_gives_each_shard_its_own_deletions_once(etcd, prefix) -> None:
    async def body() -> None:
        store = EtcdStore(etcd.url, prefix=prefix)
        client = await store.connect()
        try:
            g0, g1 = groups_of_shards(2, 4)
            got: dict[int, list[tuple[str, str, int]]] = {0: [], 1: []}

            def collector(shard: int):
                async def on_expired(group: str, job: str, token: int) -> None:
                    got[shard].append((group, job, token))
                return on_expired

            async def turn(group: str, token: int, delete: bool = True) -> int:
                await client.put(store.turn_key(group), f'{{"job": "j", "token": {token}}}'.encode())
                if delete:
                    await client.delete(store.turn_key(group))
                return (await client.get(store.turn_key(group))).header.revision

            start = await turn(g1, 1) + 1  # shard 1 subscribes from here, later: it gets token 2 but not 1
            watch = TurnWatch(client, store.turns_prefix, lambda g: shard_of(g, 4))
            first = watch.subscribe(0, start, collector(0))
            await turn(g0, 1)
            await turn(g1, 2)
            await turn(g0, 2, delete=False)  # a put alone: no event
            deadline = time.monotonic() + 5
            while not got[0] and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            watch.subscribe(1, start, collector(1))  # behind the stream: it restarts from there
            await turn(g1, 3)
            while len(got[1]) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.2)
            assert got == {0: [(g0, "j", 1)], 1: [(g1, "j", 2), (g1, "j", 3)]}
            await watch.unsubscribe(0, first)
            await turn(g0, 3)
            await turn(g1, 4)
            while len(got[1]) < 3 and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            assert got == {0: [(g0, "j", 1)], 1: [(g1, "j", 2), (g1, "j", 3), (g1, "j", 4)]}
            await watch.close()
        finally:
            await store.close()

    run(body())


class FakeWatch:
    """A fake of rota_etcd._etcd.Watch (the stream itself is tested against etcd above): it records where each
    stream starts, so the test can make an old stream deliver after a new one replaced it, a race real etcd
    gives only now and then."""

    made: list[FakeWatch] = []

    def __init__(self, client, prefix, start_revision, on_events, *, deletes_only: bool) -> None:
        self.next_revision, self.on_events, self.cancelled = start_revision, on_events, False
        FakeWatch.made.append(self)

    async def cancel(self) -> None:
        self.cancelled = True


def deleted(group: str, token: int, revision: int) -> rpc.Event:
    return rpc.Event(type=rpc.Event.DELETE, kv=rpc.KeyValue(key=f"/p/turns/{group}".encode(), mod_revision=revision),
                     prev_kv=rpc.KeyValue(value=json.dumps({"job": "j", "token": token}).encode()))


def test_a_replaced_turn_stream_gives_nothing_to_a_shard_that_subscribed_behind_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Shard 1 subscribes from revision 120 while the stream is at 151: a new stream replays from 120. The old
    one may still deliver revision 160 before its cancellation lands; shard 1 must then get its deletion at 130
    from the new stream, in order, and 160 once (it was skipped when the old stream counted 160 as given)."""
    monkeypatch.setattr("rota_etcd._turnwatch.Watch", FakeWatch)
    FakeWatch.made.clear()
    g0, g1 = groups_of_shards(2, 4)
    got: dict[int, list[int]] = {0: [], 1: []}

    def collector(shard: int):
        async def on_expired(group: str, job: str, token: int) -> None:
            got[shard].append(token)
        return on_expired

    async def body() -> None:
        watch = TurnWatch(None, b"/p/turns/", lambda g: shard_of(g, 4))
        watch.subscribe(0, 100, collector(0))
        old = FakeWatch.made[-1]
        await old.on_events([deleted(g0, 150, 150)], 150)
        old.next_revision = 151
        watch.subscribe(1, 120, collector(1))
        new = FakeWatch.made[-1]
        assert new is not old and new.next_revision == 120
        await old.on_events([deleted(g0, 160, 160), deleted(g1, 160, 160)], 160)  # before its cancel lands
        await new.on_events([deleted(g1, 130, 130), deleted(g0, 150, 150), deleted(g0, 160, 160),
                             deleted(g1, 160, 160)], 160)
        await watch.close()

    run(body())
    assert got == {0: [150, 160], 1: [130, 160]}
