"""Group state in etcd: the key layout, its encoding, and commits fenced by leadership.

Key layout (``PREFIX`` is ``/rota/`` unless ``ROTA_ETCD_PREFIX`` says otherwise)::

    PREFIX leader          who leads: {"id", "address", "host", "pid", "since"};
                           attached to the leader's lease. Its create_revision is the
                           leadership term: every commit compares it.
    PREFIX groups/GROUP    the group's whole state as JSON (rota._orchestrator.state.GroupState:
                           token, holder, FIFO/priority queue, residents, loaded job,
                           per-tenant GPU seconds and turns); times are wall-clock.
    PREFIX turns/GROUP     the current turn {"job", "token", "granted"}, attached to a
                           lease of the tenant TTL that the leader refreshes while the
                           tenant's heartbeats arrive; when it expires the turn ends.
                           Each new term first gives every holder a fresh lease: while
                           no orchestrator led, nobody could refresh them.

:class:`EtcdStore` is what the ``rota_store`` hook returns: it reads state for
``rota status --etcd`` and builds the HA replica (:mod:`rota_etcd._replica`). While a
replica leads, its orchestrator writes through a :class:`TermStore`, bound to that one
term: each commit is a transaction conditioned on (a) the leader key still having
the term's create_revision and (b) the group key still having the revision this
term last wrote. A deposed leader's commit therefore fails, and so does one racing
any other writer; a failed or uncertain commit ends the term (the replica reloads
from etcd before it serves again), so memory never drifts from etcd.

Environment:
    ROTA_ETCD_PREFIX      key prefix (default ``/rota``), to share one etcd
    ROTA_ETCD_TIMEOUT     seconds an etcd call may take before UNAVAILABLE (default 2)
    ROTA_ETCD_LEADER_TTL  seconds a dead leader keeps its term (default 5, at least 2)
    ROTA_ETCD_SHARDS      shards the groups are split into, each led by one replica
                          (default 1: one leader for all; the same on every replica)

With ``ROTA_ETCD_SHARDS`` N > 1 each shard has its own ``PREFIX shards/S/leader`` key
(S = 0..N-1, see :mod:`rota_etcd._shards`), term and fencing; ``PREFIX shardcount``
records N, and ``PREFIX replicas/ID`` lists the live replicas (on their leases).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from rota.config import check_id, env_float
from rota.errors import ConfigError, NotFound, Unavailable
from rota.orchestrator import GroupState
from rota_etcd._etcd import (
    EtcdClient,
    LeaseKeeper,
    cmp_create,
    cmp_mod,
    op_delete,
    op_get,
    op_put,
    parse_endpoints,
    tls_credentials,
)
from rota_etcd._shards import shard_of
from rota_etcd._turnwatch import OnExpired, TurnWatch

log = logging.getLogger(__name__)

STORED_SAMPLES = 32  # recent waits/parks per tenant kept in etcd (the leader keeps more in memory)
SPARE_LEASES = 2  # turn leases granted ahead, so a grant costs one etcd round trip, not two
MAX_SPARE_LEASES = 16  # ended turns' leases kept for reuse, at most


def _env_shards() -> int:
    raw = os.environ.get("ROTA_ETCD_SHARDS", "").strip() or "1"
    if not raw.isdigit() or not 1 <= int(raw) <= 1024:
        raise ConfigError(f"ROTA_ETCD_SHARDS={raw!r} is not a shard count; set a whole number from 1 to 1024 "
                          "(the same on every replica) or unset it")
    return int(raw)


# ----------------------------------------------------------------- encoding
# GroupState keeps time.monotonic() values; etcd keeps wall-clock ones, so a state
# written on one host reads correctly on another (as far as their clocks agree).


_GROUP_FIELDS = tuple(f.name for f in dataclasses.fields(GroupState) if f.name != "tenants")
_JSON = json.JSONEncoder(separators=(",", ":")).encode

TenantCache = dict[str, tuple[tuple, str]]  # job -> (what its record held, its JSON)


def encode_state(state: GroupState, cache: TenantCache | None = None) -> bytes:
    """``state`` as etcd keeps it. With ``cache`` (one per group, kept by the caller between
    commits), a tenant record that did not change since the last call reuses its JSON: a
    commit usually changes one of the group's tenants, and encoding them all was most of
    its CPU."""
    # Built field by field, not with GroupState.to_dict(): dataclasses.asdict deep-copies
    # every tenant's 512 recent samples.
    shift = time.time() - time.monotonic()
    d = {name: getattr(state, name) for name in _GROUP_FIELDS}
    for name in ("created", "holder_since"):
        if d[name]:
            d[name] = round(d[name] + shift, 4)
    d["released_ranks"] = sorted(state.released_ranks)
    d["queue"] = [dict(vars(w), arrived=round(w.arrived + shift, 4)) for w in state.queue]
    d["residents"] = list(state.residents)
    tenants = []
    fresh: TenantCache = {}
    step = round(shift)  # a clock step (NTP) re-encodes every tenant: their wall-clock times moved with it
    for job, rec in state.tenants.items():
        key = (step, *_tenant_key(rec))
        hit = cache.get(job) if cache is not None else None
        text = hit[1] if hit is not None and hit[0] == key else _JSON(_encode_tenant(rec, shift))
        fresh[job] = (key, text)
        tenants.append(f"{_JSON(job)}:{text}")
    if cache is not None:  # tenants collected since are dropped with their JSON
        cache.clear()
        cache.update(fresh)
    head = _JSON(d)
    return f"{head[:-1]},\"tenants\":{{{','.join(tenants)}}}}}".encode()


def _recent(samples: Any) -> list[float]:
    """The last STORED_SAMPLES of a deque, oldest first (without walking the older ones)."""
    out = list(itertools.islice(reversed(samples), STORED_SAMPLES))
    out.reverse()
    return out


def _tenant_key(rec: Any) -> tuple:
    """Everything of a tenant record that its stored form shows (what makes its cached JSON stale)."""
    return (*(v for k, v in vars(rec).items() if k not in ("waits_ms", "parks_ms")),
            *_recent(rec.waits_ms), None, *_recent(rec.parks_ms))


def _encode_tenant(rec: Any, shift: float) -> dict[str, Any]:
    out = dict(vars(rec))
    if out["last_active"]:  # wall clock in etcd, like the group's times, so collection reads it right on any
        # host; whole seconds (collection counts minutes), so a cached record's JSON stays what a fresh one gives
        out["last_active"] = round(out["last_active"] + shift)
    for name in ("waits_ms", "parks_ms"):
        out[name] = [round(x, 2) for x in _recent(out[name])]
    return out


def decode_state(raw: bytes) -> GroupState:
    d = json.loads(raw)
    shift = time.monotonic() - time.time()
    for name in ("created", "holder_since"):
        if d.get(name):
            d[name] += shift
    for w in d.get("queue", ()):
        w["arrived"] += shift
    for rec in d.get("tenants", {}).values():
        if rec.get("last_active"):
            rec["last_active"] += shift
    return GroupState.from_dict(d)


def _turn_value(job: str, token: int) -> bytes:
    return json.dumps({"job": job, "token": token, "granted": round(time.time(), 4)}).encode()


@dataclass
class Turn:
    """The current turn of a group as etcd knows it, with the lease that bounds it."""

    job: str
    token: int
    lease: int


@dataclass
class Snapshot:
    """Everything under the prefix, read at one etcd revision."""

    groups: dict[str, GroupState]
    revs: dict[str, int]  # group -> mod_revision of its key
    turns: dict[str, Turn]
    leader: dict[str, Any] | None
    revision: int


@dataclass
class Term:
    """One leadership term of one replica: the proof every commit carries."""

    revision: int  # create_revision of the leader key: grows with every term
    lease: int
    ttl_s: float
    lost: asyncio.Event = field(default_factory=asyncio.Event)
    why: str = ""

    def end(self, why: str) -> None:
        if not self.lost.is_set():
            self.why = why
            self.lost.set()


# -------------------------------------------------------------------- store


class EtcdStore:
    """Group state in an etcd cluster (the object the ``rota_store`` hook returns).

    Creating it only parses the URL; :meth:`connect` reaches etcd.
    """

    def __init__(self, url: str, *, prefix: str | None = None) -> None:
        self.url = url
        self.endpoints = parse_endpoints(url)
        self.tls = tls_credentials(url)  # https:// members: ROTA_ETCD_CA (+ CERT/KEY for client-cert auth)
        raw_prefix = prefix if prefix is not None else os.environ.get("ROTA_ETCD_PREFIX", "/rota")
        self.prefix = "/" + raw_prefix.strip("/") + "/" if raw_prefix.strip("/") else "/"
        self.timeout = env_float("ROTA_ETCD_TIMEOUT", 2.0, minimum=0.1)
        self.leader_ttl = env_float("ROTA_ETCD_LEADER_TTL", 5.0, minimum=2.0)
        self.shards = _env_shards()
        self.client: EtcdClient | None = None
        self.keeper: LeaseKeeper | None = None
        self._turn_watch: TurnWatch | None = None

    # keys
    @property
    def leader_key(self) -> bytes:
        return f"{self.prefix}leader".encode()

    def shard_leader_key(self, shard: int) -> bytes:
        """The leader key of ``shard`` (the one ``PREFIX leader`` when groups are not sharded)."""
        return self.leader_key if self.shards == 1 else f"{self.prefix}shards/{shard}/leader".encode()

    @property
    def replicas_prefix(self) -> bytes:
        return f"{self.prefix}replicas/".encode()

    def shard_of(self, group_id: str) -> int:
        return shard_of(group_id, self.shards)

    def group_key(self, group_id: str) -> bytes:
        return f"{self.prefix}groups/{group_id}".encode()

    def turn_key(self, group_id: str) -> bytes:
        return f"{self.prefix}turns/{group_id}".encode()

    @property
    def groups_prefix(self) -> bytes:
        return f"{self.prefix}groups/".encode()

    @property
    def turns_prefix(self) -> bytes:
        return f"{self.prefix}turns/".encode()

    # ------------------------------------------------------------ lifecycle

    async def connect(self, timeout: float | None = None) -> EtcdClient:
        """Reach etcd, or raise Unavailable naming every endpoint tried."""
        if self.client is None:
            self.client = EtcdClient(self.endpoints, timeout=self.timeout, tls=self.tls)
            self.keeper = LeaseKeeper(self.client)
        try:
            await self.client.status(timeout=timeout or max(self.timeout, 3.0))
        except Unavailable as exc:
            raise Unavailable(f"cannot reach etcd at {self.client.describe()}: {exc}; start etcd there or "
                              "fix --etcd / ROTA_ETCD") from None
        return self.client

    def turn_watch(self) -> TurnWatch:
        """The one watch of turn keys that every shard led here subscribes to."""
        if self._turn_watch is None:
            assert self.client is not None
            self._turn_watch = TurnWatch(self.client, self.turns_prefix, self.shard_of)
        return self._turn_watch

    async def close(self) -> None:
        if self._turn_watch is not None:
            await self._turn_watch.close()
            self._turn_watch = None
        if self.keeper is not None:
            await self.keeper.stop()
        if self.client is not None:
            await self.client.close()
        self.client = self.keeper = None

    async def check_shards(self) -> None:
        """Record ROTA_ETCD_SHARDS in etcd, or refuse to run with a count other than the recorded one
        (two counts would give one group two leaders)."""
        client = self.client or await self.connect()
        key = f"{self.prefix}shardcount".encode()
        reply = await client.txn([cmp_create(key, 0)], [op_put(key, str(self.shards).encode())], [op_get(key)],
                                 what="recording the shard count", retry=True)
        if reply.succeeded:
            return
        kvs = reply.responses[0].response_range.kvs
        recorded = kvs[0].value.decode(errors="replace") if kvs else ""
        if kvs and recorded != str(self.shards):
            raise ConfigError(f"ROTA_ETCD_SHARDS={self.shards} but the replicas under {self.prefix!r} in etcd use "
                              f"{recorded}; set ROTA_ETCD_SHARDS={recorded} on every replica")

    # ---------------------------------------------------------------- reads

    async def read(self) -> Snapshot:
        """Every group, every turn and the leader, at one revision (linearizable)."""
        client = self.client or await self.connect()
        reply = await client.get(self.prefix.encode(), prefix=True)
        snap = Snapshot({}, {}, {}, None, reply.header.revision)
        groups, turns = self.groups_prefix.decode(), self.turns_prefix.decode()
        for kv in reply.kvs:
            key = kv.key.decode()
            try:
                if key.startswith(groups):
                    g = decode_state(kv.value)
                    snap.groups[g.group_id] = g
                    snap.revs[g.group_id] = kv.mod_revision
                elif key.startswith(turns):
                    d = json.loads(kv.value)
                    snap.turns[key[len(turns):]] = Turn(d["job"], int(d["token"]), kv.lease)
                elif kv.key == self.leader_key:
                    snap.leader = json.loads(kv.value)
            except (ValueError, KeyError, TypeError) as exc:
                log.error("ignoring unreadable etcd key %s: %s", key, exc)
        return snap

    async def load_all(self) -> dict[str, GroupState]:
        """Every stored group (GroupStore protocol; read-only: commits need a term)."""
        return (await self.read()).groups

    async def commit(self, state: GroupState) -> None:
        raise Unavailable(f"group {state.group_id!r}: this orchestrator does not lead; only the elected "
                          "leader writes to etcd", group_id=state.group_id)

    async def status(self, group_id: str = "") -> list[GroupState]:
        """Groups as etcd has them (what followers and ``rota status --etcd`` show)."""
        groups = await self.load_all()
        if group_id:
            check_id("group_id", group_id, group_id=group_id)
            if group_id not in groups:
                known = ", ".join(sorted(groups)) or "none"
                raise NotFound(f"group {group_id!r} does not exist in etcd at {self.url} (known: {known})",
                               group_id=group_id)
            return [groups[group_id]]
        return [groups[k] for k in sorted(groups)]

    def begin_term(self, term: Term, turn_ttl_s: float, shard: int = 0) -> TermStore:
        return TermStore(self, term, turn_ttl_s, shard)


class TermStore:
    """The store an elected leader's orchestrator writes through, valid for one term only."""

    def __init__(self, parent: EtcdStore, term: Term, turn_ttl_s: float, shard: int = 0) -> None:
        assert parent.client is not None and parent.keeper is not None
        self.parent, self.term, self.shard = parent, term, shard
        self.leader_key = parent.shard_leader_key(shard)
        self.client, self.keeper = parent.client, parent.keeper
        self.turn_ttl = max(2, math.ceil(turn_ttl_s))
        self.revs: dict[str, int] = {}  # group -> mod_revision this term expects
        self.turns: dict[str, Turn] = {}
        self._encoded: dict[str, TenantCache] = {}  # group -> its tenants' JSON as last committed
        self.revision = 0  # etcd revision of the load
        self._watch: object | None = None  # this term's TurnWatch subscription
        self._background: set[asyncio.Task] = set()
        self._spares: list[int] = []
        self._refilling = False

    # ------------------------------------------------------- GroupStore API

    async def load_all(self) -> dict[str, GroupState]:
        snap = await self.parent.read()
        mine = self._mine
        snap.groups = {g: state for g, state in snap.groups.items() if mine(g)}
        self.revs, self.revision = {g: r for g, r in snap.revs.items() if mine(g)}, snap.revision
        old = {g: turn for g, turn in snap.turns.items() if mine(g)}
        # Nobody refreshed turn leases while no orchestrator led, however long that was:
        # an expiry then says nothing about the tenant. Every holder gets a fresh lease,
        # i.e. one TTL from now to show it lives (as the orchestrator gives it to re-attach).
        holders = [(g.group_id, g.holder, g.token) for g in snap.groups.values() if g.holder]
        for i in range(0, len(holders), 64):
            await self._restore_turns(holders[i:i + 64])
        for turn in old.values():
            self._spawn(self.client.lease_revoke(turn.lease))
        return snap.groups

    async def commit(self, state: GroupState) -> None:
        """Write ``state`` if this term still leads and nobody else wrote the group."""
        g = state.group_id
        self._check_term(g)
        key, tkey = self.parent.group_key(g), self.parent.turn_key(g)
        value = encode_state(state, self._encoded.setdefault(g, {}))
        ops = [op_put(key, value)]
        old = self.turns.get(g)
        new = old
        if state.holder and (old is None or (old.job, old.token) != (state.holder, state.token)):
            new = Turn(state.holder, state.token, await self._turn_lease())
            ops.append(op_put(tkey, _turn_value(state.holder, state.token), new.lease))
        elif not state.holder and old is not None:
            new = None
            ops.append(op_delete(tkey))
        self._check_term(g)
        try:
            # Retried across members: the compares make a double application impossible.
            reply = await self.client.txn(
                [cmp_create(self.leader_key, self.term.revision), cmp_mod(key, self.revs.get(g, 0))],
                ops, [op_get(self.leader_key), op_get(key)], what=f"the commit of group {g!r}", retry=True)
        except Unavailable as exc:
            self.term.end(f"commit of group {g!r} failed: {exc}")
            if new is not old and new is not None:
                self._discard(new.lease)
            raise
        revision = reply.header.revision
        if not reply.succeeded:
            revision = self._applied_earlier(reply, value)
        if not revision:
            why = (f"etcd refused the commit of group {g!r}: this replica's leadership (term "
                   f"{self.term.revision}) ended or another writer changed the group")
            self.term.end(why)
            if new is not old and new is not None:
                self._discard(new.lease)
            raise Unavailable(f"{why}; retry against the current leader", group_id=g)
        self.revs[g] = revision
        if new is not old:
            if old is not None:
                self._recycle(old.lease)
            if new is not None:
                self.turns[g] = new
                self.keeper.keep(new.lease, self.turn_ttl, None)
            else:
                self.turns.pop(g, None)

    async def delete(self, group_id: str) -> None:
        """Forget an idle group (no holder, so no turn key), if this term still leads and nobody changed it."""
        self._check_term(group_id)
        key = self.parent.group_key(group_id)
        reply = await self.client.txn(
            [cmp_create(self.leader_key, self.term.revision), cmp_mod(key, self.revs.get(group_id, 0))],
            [op_delete(key)], [], what=f"forgetting group {group_id!r}", retry=True)
        if not reply.succeeded:
            raise Unavailable(f"etcd refused to forget group {group_id!r}: this replica's leadership ended or "
                              "another writer changed it", group_id=group_id)
        self.revs.pop(group_id, None)
        self._encoded.pop(group_id, None)

    def _applied_earlier(self, reply: Any, value: bytes) -> int:
        """After a refused retry: the group's revision if an earlier try of this very
        commit was applied (its reply lost), else 0."""
        leader, group = (r.response_range.kvs for r in reply.responses)
        if leader and leader[0].create_revision == self.term.revision and group and group[0].value == value:
            return group[0].mod_revision
        return 0

    # ------------------------------------------------------------- extras

    def _mine(self, group_id: str) -> bool:
        return self.parent.shard_of(group_id) == self.shard

    async def verify(self, group_id: str) -> None:
        """Prove (one linearizable round trip) that this term still leads and the group
        is as this term last wrote it; else end the term and raise Unavailable."""
        self._check_term(group_id)
        key = self.parent.group_key(group_id)
        try:
            reply = await self.client.txn([cmp_create(self.leader_key, self.term.revision),
                                           cmp_mod(key, self.revs.get(group_id, 0))], [],
                                          what=f"the leadership check for group {group_id!r}", retry=True)
        except Unavailable as exc:
            self.term.end(f"leadership check failed: {exc}")
            raise
        if not reply.succeeded:
            self.term.end("leadership check refused by etcd")
            raise Unavailable(f"group {group_id!r}: this replica no longer leads (term {self.term.revision}); "
                              "retry against the current leader", group_id=group_id)

    async def _turn_lease(self) -> int:
        """A fresh turn lease: a spare granted ahead of time if etcd confirmed it lately, else a new grant."""
        lease = 0
        while self._spares and not lease:
            spare = self._spares.pop()
            if self._confirmed_for_a_turn(spare):
                lease = spare
            else:
                self._discard(spare)
        if not lease:
            lease = (await self.client.lease_grant(self.turn_ttl))[0]
        if not self._refilling:
            self._refilling = True
            self._spawn(self._refill())
        return lease

    async def _refill(self) -> None:
        try:
            while len(self._spares) < SPARE_LEASES and not self.term.lost.is_set():
                lease, _ = await self.client.lease_grant(self.turn_ttl)
                self.keeper.keep(lease, self.turn_ttl, self._spare_gone)
                self._spares.append(lease)
        finally:
            self._refilling = False

    def _recycle(self, lease: int) -> None:
        """An ended turn's lease (its key now deleted or moved to the next turn's lease) becomes a spare
        while etcd confirmed it lately: the next grant then needs no LeaseGrant and this one no LeaseRevoke.

        Being kept is not enough: a lease let go while its holder was silent and kept again
        may have expired meanwhile, and a turn put on it would end as soon as it began."""
        if (self._confirmed_for_a_turn(lease) and len(self._spares) < MAX_SPARE_LEASES
                and not self.term.lost.is_set()):
            self.keeper.keep(lease, self.turn_ttl, self._spare_gone)
            self._spares.append(lease)
            return
        self._discard(lease)

    def _confirmed_for_a_turn(self, lease: int) -> bool:
        """True if etcd confirmed ``lease`` recently enough that over half its TTL is certainly left."""
        return self.keeper.valid_until(lease) - time.monotonic() > self.turn_ttl / 2

    def _discard(self, lease: int) -> None:
        self.keeper.drop(lease)
        self._spawn(self.client.lease_revoke(lease))

    def _spare_gone(self, lease: int) -> None:
        if lease in self._spares:
            self._spares.remove(lease)

    async def _restore_turns(self, holders: list[tuple[str, str, int]]) -> None:
        """Fresh turn leases for (group, job, token) holders, in one transaction."""
        leases = await asyncio.gather(*(self._turn_lease() for _ in holders))
        reply = await self.client.txn(
            [cmp_create(self.leader_key, self.term.revision)],
            [op_put(self.parent.turn_key(g), _turn_value(job, token), lease)
             for (g, job, token), lease in zip(holders, leases, strict=True)],
            what="restoring turn leases", retry=True)
        if not reply.succeeded:
            self.term.end("leadership lost while restoring turn leases")
            raise Unavailable("leadership lost while restoring turn leases")
        for (g, job, token), lease in zip(holders, leases, strict=True):
            self.turns[g] = Turn(job, token, lease)
            self.keeper.keep(lease, self.turn_ttl, None)
        # the turn watch starts after this: the old leases' expiries no longer touch these keys
        self.revision = max(self.revision, reply.header.revision)

    def keep_turn(self, group_id: str, alive: bool) -> None:
        """Refresh the holder's turn lease while ``alive``; stop (let it expire) if not."""
        turn = self.turns.get(group_id)
        if turn is None:
            return
        if alive:  # after a drop the lease may be gone: unconfirmed until etcd says otherwise
            self.keeper.keep(turn.lease, self.turn_ttl, None, fresh=False)
        else:
            self.keeper.drop(turn.lease)

    def watch_turns(self, on_expired: OnExpired) -> None:
        """Call ``on_expired(group, job, token)`` when a turn key of this shard vanishes (lease
        expiry, or this term's own release: the callback checks the token)."""
        self._watch = self.parent.turn_watch().subscribe(self.shard, self.revision + 1, on_expired)

    async def close(self) -> None:
        """End of term: stop watching and refreshing (leases stay for the next leader)."""
        if self._watch is not None:
            await self.parent.turn_watch().unsubscribe(self.shard, self._watch)
        for turn in self.turns.values():
            self.keeper.drop(turn.lease)
        for task in list(self._background):
            task.cancel()
        spares, self._spares = self._spares, []
        for lease in spares:  # never used: give them back now rather than let them expire
            self.keeper.drop(lease)
            with contextlib.suppress(Unavailable):
                await self.client.lease_revoke(lease)

    def _check_term(self, group_id: str) -> None:
        if self.term.lost.is_set():
            raise Unavailable(f"group {group_id!r}: this replica's leadership ended ({self.term.why}); retry "
                              "against the current leader", group_id=group_id)

    def _spawn(self, coro: Awaitable[Any]) -> None:
        async def quiet() -> None:
            try:
                await coro
            except Exception as exc:  # best-effort cleanup: an orphan lease just expires
                log.debug("background etcd call failed: %s", exc)

        task = asyncio.create_task(quiet())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
