"""Leader election among orchestrator replicas, through one etcd key.

A replica campaigns by creating ``PREFIX leader`` (compare create_revision == 0)
attached to its own lease. The winner's *term* is the key's create_revision, which
grows with every term and is the fencing proof its commits carry
(:class:`rota_etcd._store.TermStore`). Losers read the key (the leader's address,
for redirects) and watch it; when it is deleted — the leader resigned, or its lease
expired because it died — they campaign again.

A term ends when etcd says the lease is gone, when the lease could not be refreshed
for its TTL minus a margin (the leader stops *before* etcd could let another
replica win), when a commit is refused, or when the replica stops.

Used by :mod:`rota_etcd._replica`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from rota.errors import Unavailable
from rota_etcd._etcd import Watch, cmp_create, op_delete, op_get, op_put
from rota_etcd._store import EtcdStore, Term

log = logging.getLogger(__name__)

VALIDITY_MARGIN_S = 0.75  # a leader stops this long before its lease could expire in etcd
DEFER_S = 0.5  # a replica that should not lead a shard waits this long before campaigning for it


class Election:
    """One replica's view of the election: campaign, observe the leader, resign."""

    def __init__(self, store: EtcdStore, identity: dict[str, Any], key: bytes | None = None) -> None:
        self.store = store
        self.identity = identity
        self.key = key or store.leader_key  # one shard's leader key (see rota_etcd._shards)
        self.leader: dict[str, Any] | None = None  # last known leader (maybe us)

    @property
    def ttl_s(self) -> float:
        return self.store.leader_ttl

    async def campaign(self, stop: asyncio.Event, eager: Callable[[], bool] = lambda: True) -> Term | None:
        """Return a new term once this replica wins; None if ``stop`` is set first.

        While ``eager()`` is false (another live replica should lead this shard) the
        replica waits :data:`DEFER_S` before each try, so that one wins first; it
        still wins a key nobody takes.

        etcd being unreachable is not an error here: the replica keeps trying (and
        answers UNAVAILABLE meanwhile), so service resumes when etcd returns.
        """
        key = self.key
        delay = 0.1
        while not stop.is_set():
            if not eager():
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), DEFER_S)
                if stop.is_set():
                    return None
            try:
                client = self.store.client or await self.store.connect()
                lease, granted = await client.lease_grant(max(2, round(self.ttl_s)))
                me = dict(self.identity, since=round(time.time(), 3))
                reply = await client.txn([cmp_create(key, 0)], [op_put(key, json.dumps(me).encode(), lease)],
                                         [op_get(key)], what="the leader election", retry=True)
                if reply.succeeded:
                    term = Term(revision=reply.header.revision, lease=lease, ttl_s=float(granted))
                    self.store.keeper.keep(lease, granted, functools.partial(_lease_gone, term))
                    self.leader = me
                    log.info("replica %s leads (term %d)", self.identity["id"], term.revision)
                    return term
                await client.lease_revoke(lease)
                kvs = reply.responses[0].response_range.kvs
                if not kvs:  # deleted between compare and read: try again at once
                    continue
                kv = kvs[0]
                self.leader = _decode(kv.value)
                if self.leader.get("id") == self.identity["id"]:  # our own earlier term, no longer kept
                    await client.txn([cmp_create(key, kv.create_revision)], [op_delete(key)],
                                     what="removing this replica's stale leader key")
                    continue
                await self._wait_vacant(kv.mod_revision + 1, stop)
                delay = 0.1
            except Unavailable as exc:
                self.leader = None
                log.warning("leader election: %s; retrying in %.1f s", exc, delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
                delay = min(delay * 2, 2.0)
        return None

    async def _wait_vacant(self, revision: int, stop: asyncio.Event) -> None:
        """Wait until the leader key is deleted (or ``stop``); track leader changes."""
        vacant = asyncio.Event()

        async def on_events(events: list, _rev: int) -> None:
            for ev in events:
                if ev.type == ev.DELETE:
                    vacant.set()
                else:
                    self.leader = _decode(ev.kv.value)

        watch = Watch(self.store.client, self.key, revision, on_events, exact=True)
        try:
            waiters = [asyncio.create_task(vacant.wait()), asyncio.create_task(stop.wait())]
            # also re-check now and then, in case the watch missed a beat
            await asyncio.wait(waiters, timeout=max(self.ttl_s, 2.0), return_when=asyncio.FIRST_COMPLETED)
            for t in waiters:
                t.cancel()
        finally:
            await watch.cancel()

    def still_valid(self, term: Term) -> bool:
        """True while the term's lease is certainly alive in etcd (with a margin)."""
        until = self.store.keeper.valid_until(term.lease)
        return time.monotonic() < until - min(VALIDITY_MARGIN_S, term.ttl_s / 3)

    async def resign(self, term: Term) -> None:
        """Give up the term now (the next replica wins at once, not after a TTL)."""
        term.end("resigned")
        self.store.keeper.drop(term.lease)
        client = self.store.client
        if client is None:
            return
        with contextlib.suppress(Unavailable):
            await client.txn([cmp_create(self.key, term.revision)], [op_delete(self.key)],
                             what="resigning leadership")
            await client.lease_revoke(term.lease)
        if self.leader and self.leader.get("id") == self.identity["id"]:
            self.leader = None


def _lease_gone(term: Term, _lease: int) -> None:
    term.end("the leader lease expired in etcd")


def _decode(raw: bytes) -> dict[str, Any]:
    try:
        value = json.loads(raw)
        return value if isinstance(value, dict) else {}
    except ValueError:
        return {}
