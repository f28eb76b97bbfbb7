"""The etcd store against a real etcd: encoding, fenced commits, turn leases, election."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any

import pytest
from etcd_testlib import run

from rota.errors import ConfigError, Unavailable
from rota.orchestrator import GroupState
from rota.types import TenantRecord, TurnRequest
from rota_etcd._election import Election
from rota_etcd._etcd import parse_endpoints
from rota_etcd._store import EtcdStore, decode_state, encode_state


def granted(group: str, *jobs: str) -> GroupState:
    """A group whose first job holds it and the others wait, in order."""
    g = GroupState(group, created=time.monotonic())
    for job in jobs:
        g.enqueue(TurnRequest(job, group), time.monotonic())
    g.begin_switch(g.queue[0], 0)
    g.complete_grant(time.monotonic())
    return g


async def leading_term(store: EtcdStore, turn_ttl_s: float) -> Any:
    """``store`` connected, elected alone, and its term's store loaded (turn leases of ``turn_ttl_s``)."""
    await store.connect()
    term = await Election(store, {"id": "a", "address": "A"}).campaign(asyncio.Event())
    ts = store.begin_term(term, turn_ttl_s)
    await ts.load_all()
    return ts


def test_state_round_trips_through_json_with_wall_clock_times() -> None:
    g = granted("g", "a", "b", "c")
    back = decode_state(encode_state(g))
    assert (back.holder, back.token, [w.job_id for w in back.queue]) == ("a", 1, ["b", "c"])
    assert abs(back.holder_since - g.holder_since) < 0.01
    assert abs(back.queue[0].arrived - g.queue[0].arrived) < 0.01
    assert b'"holder_since":1' in encode_state(g)  # wall clock (2020s), not this boot's monotonic clock


def test_quiet_turn_round_trips_and_older_state_loads_as_not_quiet() -> None:
    g = GroupState("g", created=time.monotonic())
    g.enqueue(TurnRequest("a", "g", quiet=True), time.monotonic())
    g.begin_switch(g.queue[0], 0)
    g.complete_grant(time.monotonic())
    g.enqueue(TurnRequest("b", "g", quiet=True), time.monotonic())
    back = decode_state(encode_state(g))
    assert back.holder_quiet and back.queue[0].quiet
    old = json.loads(encode_state(g))  # as a replica before TurnRequest.quiet wrote it
    del old["holder_quiet"], old["queue"][0]["quiet"]
    back = decode_state(json.dumps(old).encode())
    assert back.holder == "a" and not back.holder_quiet and not back.queue[0].quiet


def test_a_tenants_idle_age_survives_a_failover_to_a_host_with_another_monotonic_clock(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Collection of ended tenants and idle groups reads each tenant's last activity: etcd keeps it as wall
    clock, so the replica that loads the group on another host (another boot, another monotonic clock) sees
    the same age. Stored as this host's monotonic time, the age read there was off by the hosts' uptimes."""
    g = granted("g", "a")
    g.tenants["b"] = TenantRecord("b", state="idle", last_active=time.monotonic() - 600)  # ended 10 minutes ago
    raw = encode_state(g)
    assert b'"last_active":1' in raw  # wall clock (2020s), not this boot's monotonic clock
    other_boot = time.monotonic() + 1e6  # the new leader's host has been up 11.6 days longer
    monkeypatch.setattr("rota_etcd._store.time.monotonic", lambda: other_boot)
    back = decode_state(raw)
    assert abs((other_boot - back.tenants["b"].last_active) - 600) < 2
    assert back.collect(other_boot, ttl_s=900, keep=set()) == []  # not yet: 10 of its 15 minutes
    assert back.collect(other_boot, ttl_s=300, keep=set()) == ["b"]


def test_endpoints_parse_and_bad_urls_name_the_problem() -> None:
    assert parse_endpoints("http://127.0.0.1:2379, 10.0.0.2:2380,etcd-0") == [
        "127.0.0.1:2379", "10.0.0.2:2380", "etcd-0:2379"]
    for bad in ("", "ftp://x:1", "http://h:99999", "http://h:1/path"):
        with pytest.raises(ConfigError, match="etcd"):
            parse_endpoints(bad)


def test_commit_without_leadership_is_refused(etcd, prefix) -> None:
    async def body() -> None:
        store = EtcdStore(etcd.url, prefix=prefix)
        try:
            with pytest.raises(Unavailable, match="does not lead"):
                await store.commit(granted("g", "a"))
            assert await store.load_all() == {}
        finally:
            await store.close()

    run(body())


def test_deposed_leader_cannot_write_and_the_next_term_sees_the_last_committed_state(etcd, prefix) -> None:
    async def body() -> None:
        a, b = EtcdStore(etcd.url, prefix=prefix), EtcdStore(etcd.url, prefix=prefix)
        await a.connect()
        await b.connect()
        stop = asyncio.Event()
        try:
            ea, eb = Election(a, {"id": "a", "address": "A"}), Election(b, {"id": "b", "address": "B"})
            term_a = await ea.campaign(stop)
            store_a = a.begin_term(term_a, 5)
            assert await store_a.load_all() == {}
            g = granted("g", "j1", "j2")
            await store_a.commit(g)

            waiting = asyncio.create_task(eb.campaign(stop))
            await asyncio.sleep(0.3)
            assert not waiting.done(), "a second replica won while the first leads"
            assert eb.leader["address"] == "A"

            # a's lease ends in etcd while a does not notice (a long GC pause, a partition...)
            a.keeper.drop(term_a.lease)
            await a.client.lease_revoke(term_a.lease)
            term_b = await asyncio.wait_for(waiting, 10)
            assert term_b.revision > term_a.revision
            store_b = b.begin_term(term_b, 5)
            seen = await store_b.load_all()
            assert (seen["g"].holder, seen["g"].token, [w.job_id for w in seen["g"].queue]) == ("j1", 1, ["j2"])

            # the deposed leader tries to hand the group on: etcd refuses, nothing changes
            g.release("j1", 1, 0, time.monotonic())
            g.begin_switch(g.queue[0], 0)
            g.complete_grant(time.monotonic())
            assert not term_a.lost.is_set()
            with pytest.raises(Unavailable, match="refused the commit"):
                await store_a.commit(g)
            assert term_a.lost.is_set()
            after = (await b.load_all())["g"]
            assert (after.holder, after.token) == ("j1", 1)
            with pytest.raises(Unavailable):
                await store_a.commit(g)  # and it stays refused
        finally:
            stop.set()
            await a.close()
            await b.close()

    run(body())


def test_a_commit_racing_another_writer_is_refused_and_ends_the_term(etcd, prefix) -> None:
    async def body() -> None:
        store = EtcdStore(etcd.url, prefix=prefix)
        try:
            ts = await leading_term(store, 5)
            g = granted("g", "j1")
            await ts.commit(g)
            await store.client.put(store.group_key("g"), encode_state(granted("g", "intruder")))
            with pytest.raises(Unavailable, match="another writer"):
                await ts.commit(g)
            assert ts.term.lost.is_set()
        finally:
            await store.close()

    run(body())


def test_every_grant_has_a_turn_lease_that_ends_the_turn_when_not_kept_alive(etcd, prefix) -> None:
    async def body() -> None:
        store = EtcdStore(etcd.url, prefix=prefix)
        try:
            ts = await leading_term(store, 2)
            expired: list[tuple[str, str, int]] = []

            async def on_expired(group: str, job: str, token: int) -> None:
                expired.append((group, job, token))

            ts.watch_turns(on_expired)
            g = granted("g", "j1", "j2")
            await ts.commit(g)
            turn = ts.turns["g"]
            assert (turn.job, turn.token) == ("j1", 1)
            assert 0 < await store.client.lease_ttl(turn.lease) <= 2
            await asyncio.sleep(3)  # kept alive: still there after more than its TTL
            assert (await store.client.get(store.turn_key("g"))).count == 1

            ts.keep_turn("g", alive=False)  # the holder went silent
            t0 = time.monotonic()
            while not expired and time.monotonic() - t0 < 10:
                await asyncio.sleep(0.05)
            assert expired == [("g", "j1", 1)]
            assert time.monotonic() - t0 < 4.0  # TTL 2 s (+ etcd's expiry sweep)

            # a release deletes the turn key in the same transaction as the state
            g2 = granted("h", "k1")
            await ts.commit(g2)
            g2.release("k1", 1, 0, time.monotonic())
            await ts.commit(g2)
            assert (await store.client.get(store.turn_key("h"))).count == 0
        finally:
            await store.close()

    run(body())


def test_a_turn_lease_let_go_while_its_holder_was_silent_never_carries_the_next_turn(etcd, prefix) -> None:
    """The chaos test caught this: a silent holder's lease was let go, kept again for the
    moment its eviction was in flight (the holder looked alive then), and recycled as a
    spare; the next turn was put on that expiring lease and ended 7 ms after its grant."""
    async def body() -> None:
        store = EtcdStore(etcd.url, prefix=prefix)
        try:
            ts = await leading_term(store, 2)
            g = granted("g", "a", "b")
            await ts.commit(g)
            silent = ts.turns["g"].lease
            ts.keep_turn("g", alive=False)  # the holder went silent: its lease runs out in etcd
            deadline = time.monotonic() + 10
            while await store.client.lease_ttl(silent) > 0 and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.1)  # under a second was left: now it is past its TTL (etcd revokes it soon)
            ts.keep_turn("g", alive=True)  # ... and looks alive again while it is being evicted

            g.release("a", 1, 0, time.monotonic())
            await ts.commit(g)
            g.begin_switch(g.grantable()[0], 0)
            g.complete_grant(time.monotonic())
            await ts.commit(g)  # b's turn

            turn = ts.turns["g"]
            assert (turn.job, turn.token) == ("b", 2)
            assert turn.lease != silent, "the next turn was put on the lease that had run out"
            await asyncio.sleep(1.0)
            assert await store.client.lease_ttl(turn.lease) > 0
            assert (await store.client.get(store.turn_key("g"))).count == 1
        finally:
            await store.close()

    run(body())


def test_leases_outlive_a_stopped_etcd_member_that_keeps_its_connections_open(etcd3, prefix) -> None:
    """SIGSTOP leaves the keeper's stream open with nobody answering (as a cut-off
    member would): the keeper must notice the silence and refresh through another member."""
    async def body() -> None:
        store = EtcdStore(etcd3.url, prefix=prefix)
        stopped = None
        try:
            client = await store.connect()
            lease, _ = await client.lease_grant(2)
            store.keeper.keep(lease, 2)
            await asyncio.sleep(0.5)
            streaming = client.endpoints[client._current]
            stopped = next(m for m in etcd3.members if m.client_url.endswith(streaming))
            os.kill(stopped.proc.pid, signal.SIGSTOP)
            await asyncio.sleep(5)  # two and a half TTLs
            assert store.keeper.valid_until(lease) > time.monotonic(), "no refresh confirmed for 5 s"
            assert await client.lease_ttl(lease) > 0, "the lease expired while one member of three was stopped"
        finally:
            if stopped is not None:
                os.kill(stopped.proc.pid, signal.SIGCONT)
            await store.close()

    run(body())


def test_resigning_hands_over_at_once_and_a_dead_leader_within_its_ttl(etcd, prefix) -> None:
    async def body() -> None:
        stores = [EtcdStore(etcd.url, prefix=prefix) for _ in range(3)]
        stop = asyncio.Event()
        try:
            for s in stores:
                await s.connect()
            elections = [Election(s, {"id": f"r{i}", "address": f"R{i}"}) for i, s in enumerate(stores)]
            first = await elections[0].campaign(stop)
            rest = [asyncio.create_task(e.campaign(stop)) for e in elections[1:]]
            await asyncio.sleep(0.3)
            assert not any(t.done() for t in rest)

            t0 = time.monotonic()
            await elections[0].resign(first)
            done, pending = await asyncio.wait(rest, timeout=5, return_when=asyncio.FIRST_COMPLETED)
            assert len(done) == 1 and time.monotonic() - t0 < 1.0, "resign did not hand over at once"
            second = done.pop().result()
            assert second.revision > first.revision
            winner = next(i for i, t in enumerate(rest, 1) if t.done())

            t0 = time.monotonic()
            stores[winner].keeper.drop(second.lease)  # the leader dies: nobody refreshes its lease
            done, _ = await asyncio.wait(pending, timeout=10)
            elapsed = time.monotonic() - t0
            assert len(done) == 1 and 1.0 < elapsed < 4.5, f"takeover after {elapsed:.1f} s (lease TTL 2 s)"
            assert done.pop().result().revision > second.revision
        finally:
            stop.set()
            for s in stores:
                await s.close()

    run(body())
