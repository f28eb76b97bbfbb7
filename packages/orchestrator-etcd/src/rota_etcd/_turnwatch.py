"""One watch of every turn key for all the shards a replica leads.

Turn keys (``PREFIX turns/GROUP``, see :mod:`rota_etcd._store`) of every shard share one
prefix. A watch per led shard would make each of them receive, decode and drop every
other shard's events: with 12 shards led by one replica that was 12 streams carrying
every grant and release. :class:`TurnWatch` keeps one stream per replica, asks etcd for
deletions only (a turn ends when its key vanishes; puts are filtered out in etcd), and
hands each deletion to the subscriber of its group's shard, from that subscriber's start
revision on. A shard subscribing later than the stream's position restarts the stream
from its start revision; events the other subscribers already had are not given twice, and
the stream being replaced (it delivers until its cancellation lands) gives nothing to a
subscriber that came after it: it started past that subscriber's start revision.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from rota_etcd._etcd import EtcdClient, Watch

log = logging.getLogger(__name__)

OnExpired = Callable[[str, str, int], Awaitable[None]]  # (group, job, token)


@dataclass(eq=False)
class _Subscriber:
    on_expired: OnExpired
    next_revision: int  # the first revision it has not been given
    stream: int  # the first stream (generation) that covers it: older ones started past its start revision


class TurnWatch:
    """Deletions of turn keys, routed to the shard that leads each group."""

    def __init__(self, client: EtcdClient, prefix: bytes, shard_of: Callable[[str], int]) -> None:
        self.client, self.prefix, self.shard_of = client, prefix, shard_of
        self._subs: dict[int, _Subscriber] = {}
        self._watch: Watch | None = None
        self._stream = 0  # generation of self._watch

    def subscribe(self, shard: int, start_revision: int, on_expired: OnExpired) -> object:
        """Call ``on_expired(group, job, token)`` for every turn key of ``shard`` deleted at
        ``start_revision`` or later; returns the handle :meth:`unsubscribe` takes."""
        if self._watch is None or self._watch.next_revision > start_revision:
            self._restart(start_revision if self._watch is None else min(start_revision, self._watch.next_revision))
        sub = self._subs[shard] = _Subscriber(on_expired, start_revision, self._stream)
        return sub

    async def unsubscribe(self, shard: int, handle: object) -> None:
        """Stop giving ``shard``'s events to the subscriber ``handle``; the stream ends with the last one."""
        if self._subs.get(shard) is handle:
            del self._subs[shard]
        if not self._subs:
            await self.close()

    async def close(self) -> None:
        self._subs.clear()
        watch, self._watch = self._watch, None
        if watch is not None:
            await watch.cancel()

    def _restart(self, revision: int) -> None:
        old = self._watch
        self._stream += 1
        self._watch = Watch(self.client, self.prefix, revision, functools.partial(self._on_events, self._stream),
                            deletes_only=True)
        if old is not None:  # a batch it still delivers is filtered by the subscribers' revisions
            task = asyncio.create_task(old.cancel())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _on_events(self, stream: int, events: list[Any], revision: int) -> None:
        subs = {shard: sub for shard, sub in self._subs.items() if sub.stream <= stream}  # those it covers
        batches: dict[int, list[tuple[str, str, int]]] = {}
        for ev in events:
            if ev.type != ev.DELETE or not ev.prev_kv.value:
                continue
            group = ev.kv.key.decode().rsplit("/", 1)[1]
            shard = self.shard_of(group)
            sub = subs.get(shard)
            if sub is None or ev.kv.mod_revision < sub.next_revision:
                continue  # another replica's shard, one this stream does not cover, or given to it already
            try:
                d = json.loads(ev.prev_kv.value)
                batches.setdefault(shard, []).append((group, d["job"], int(d["token"])))
            except (ValueError, KeyError, TypeError) as exc:
                log.error("unreadable turn key %s: %s", ev.kv.key.decode(), exc)
        if events:  # etcd never splits one revision's events across replies
            last = events[-1].kv.mod_revision + 1
            for sub in subs.values():
                sub.next_revision = max(sub.next_revision, last)
        # each shard's expiries in order; shards side by side (one's slow commit does not hold up the others)
        await asyncio.gather(*(self._deliver(subs[shard], turns) for shard, turns in batches.items()))

    @staticmethod
    async def _deliver(sub: _Subscriber, turns: list[tuple[str, str, int]]) -> None:
        for group, job, token in turns:
            await sub.on_expired(group, job, token)


__all__ = ["OnExpired", "TurnWatch"]
