"""Group state in etcd: the key layout, its encoding, and commits fenced by leadership.

Key layout (``PREFIX`` is ``/rota/`` unless ``ROTA_ETCD_PREFIX`` says otherwise)::

    PREFIX leader          who leads: {"id", "address", "host", "pid", "since"};
                           attached to the leader's lease. Its create_revision is the
                           leadership term: every commit compares it.
    PREFIX groups/GROUP    the group's whole state as JSON (rota._state.GroupState:
                           token, holder, FIFO/priority queue, residents, loaded job,
                           per-tenant GPU seconds and turns); times are wall-clock.
    PREFIX turns/GROUP     the current turn {"job", "token", "granted"}, attached to a
                           lease that the leader refreshes while the tenant's heartbeats
                           arrive. When it expires the turn ends. Its TTL is the tenant
                           TTL plus the leader TTL, so a leader change (during which
                           nobody refreshes it) does not end a live tenant's turn.

:class:`EtcdStore` is what the ``rota_store`` hook returns: it reads state for
``rota status --etcd`` and builds the HA replica (:mod:`rota_etcd._replica`). While a
replica leads, its engine writes through a :class:`TermStore`, bound to that one
term: each commit is a transaction conditioned on (a) the leader key still having
the term's create_revision and (b) the group key still having the revision this
term last wrote. A deposed leader's commit therefore fails, and so does one racing
any other writer; a failed or uncertain commit ends the term (the replica reloads
from etcd before it serves again), so memory never drifts from etcd.

Environment:
    ROTA_ETCD_PREFIX      key prefix (default ``/rota``), to share one etcd
    ROTA_ETCD_TIMEOUT     seconds an etcd call may take before UNAVAILABLE (default 2)
    ROTA_ETCD_LEADER_TTL  seconds a dead leader keeps its term (default 5, at least 2)
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rota._engine import OrchestratorConfig
from rota._ids import check_id
from rota._state import GroupState
from rota.errors import ConfigError, NotFound, Unavailable
from rota_etcd._etcd import (
    EtcdClient,
    LeaseKeeper,
    Watch,
    cmp_create,
    cmp_mod,
    op_delete,
    op_get,
    op_put,
    parse_endpoints,
)

log = logging.getLogger(__name__)

STORED_SAMPLES = 32  # recent waits/parks per tenant kept in etcd (the leader keeps more in memory)


def _env_float(name: str, default: float, minimum: float) -> float:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number; set seconds >= {minimum:g} or unset it") from None
    if value < minimum:
        raise ConfigError(f"{name}={raw!r} is below {minimum:g}; set seconds >= {minimum:g} or unset it")
    return value


# ----------------------------------------------------------------- encoding
# GroupState keeps time.monotonic() values; etcd keeps wall-clock ones, so a state
# written on one host reads correctly on another (as far as their clocks agree).


def encode_state(state: GroupState) -> bytes:
    d = state.to_dict()
    shift = time.time() - time.monotonic()
    for name in ("created", "holder_since"):
        if d[name]:
            d[name] = round(d[name] + shift, 4)
    for w in d["queue"]:
        w["arrived"] = round(w["arrived"] + shift, 4)
    for rec in d["tenants"].values():
        rec["waits_ms"] = [round(x, 2) for x in rec["waits_ms"][-STORED_SAMPLES:]]
        rec["parks_ms"] = [round(x, 2) for x in rec["parks_ms"][-STORED_SAMPLES:]]
    return json.dumps(d, separators=(",", ":")).encode()


def decode_state(raw: bytes) -> GroupState:
    d = json.loads(raw)
    shift = time.monotonic() - time.time()
    for name in ("created", "holder_since"):
        if d.get(name):
            d[name] += shift
    for w in d.get("queue", ()):
        w["arrived"] += shift
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
        raw_prefix = prefix if prefix is not None else os.environ.get("ROTA_ETCD_PREFIX", "/rota")
        self.prefix = "/" + raw_prefix.strip("/") + "/" if raw_prefix.strip("/") else "/"
        self.timeout = _env_float("ROTA_ETCD_TIMEOUT", 2.0, 0.1)
        self.leader_ttl = _env_float("ROTA_ETCD_LEADER_TTL", 5.0, 2.0)
        self.client: EtcdClient | None = None
        self.keeper: LeaseKeeper | None = None

    # keys
    @property
    def leader_key(self) -> bytes:
        return f"{self.prefix}leader".encode()

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
            self.client = EtcdClient(self.endpoints, timeout=self.timeout)
            self.keeper = LeaseKeeper(self.client)
        try:
            await self.client.status(timeout=timeout or max(self.timeout, 3.0))
        except Unavailable as exc:
            raise Unavailable(f"cannot reach etcd at {self.client.describe()}: {exc}; start etcd there or "
                              "fix --etcd / ROTA_ETCD") from None
        return self.client

    async def close(self) -> None:
        if self.keeper is not None:
            await self.keeper.stop()
        if self.client is not None:
            await self.client.close()
        self.client = self.keeper = None

    def make_orchestrator(self, config: OrchestratorConfig, *, listen: str, advertise: str | None = None) -> Any:
        """The HA replica that serves ``config`` on ``listen`` (see :mod:`rota_etcd._replica`)."""
        from rota_etcd._replica import Replica

        return Replica(self, config, listen=listen, advertise=advertise)

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

    def begin_term(self, term: Term, turn_ttl_s: float) -> TermStore:
        return TermStore(self, term, turn_ttl_s)


class TermStore:
    """The store an elected leader's engine writes through, valid for one term only."""

    def __init__(self, parent: EtcdStore, term: Term, turn_ttl_s: float) -> None:
        assert parent.client is not None and parent.keeper is not None
        self.parent, self.term = parent, term
        self.client, self.keeper = parent.client, parent.keeper
        self.turn_ttl = max(2, math.ceil(turn_ttl_s))
        self.revs: dict[str, int] = {}  # group -> mod_revision this term expects
        self.turns: dict[str, Turn] = {}
        self.revision = 0  # etcd revision of the load
        self._watch: Watch | None = None
        self._background: set[asyncio.Task] = set()

    # ------------------------------------------------------- GroupStore API

    async def load_all(self) -> dict[str, GroupState]:
        snap = await self.parent.read()
        self.revs, self.turns, self.revision = snap.revs, snap.turns, snap.revision
        for turn in self.turns.values():  # the previous leader's turn leases: keep them going
            self.keeper.keep(turn.lease, self.turn_ttl, None)
        for g in snap.groups.values():
            turn = self.turns.get(g.group_id)
            if g.holder and (turn is None or (turn.job, turn.token) != (g.holder, g.token)):
                # its lease expired while no orchestrator ran: this term gives it one TTL
                await self._restore_turn(g.group_id, g.holder, g.token)
        return snap.groups

    async def commit(self, state: GroupState) -> None:
        """Write ``state`` if this term still leads and nobody else wrote the group."""
        g = state.group_id
        self._check_term(g)
        key, tkey = self.parent.group_key(g), self.parent.turn_key(g)
        value = encode_state(state)
        ops = [op_put(key, value)]
        old = self.turns.get(g)
        new = old
        if state.holder and (old is None or (old.job, old.token) != (state.holder, state.token)):
            lease, _ = await self.client.lease_grant(self.turn_ttl)
            new = Turn(state.holder, state.token, lease)
            ops.append(op_put(tkey, _turn_value(state.holder, state.token), lease))
        elif not state.holder and old is not None:
            new = None
            ops.append(op_delete(tkey))
        self._check_term(g)
        try:
            # Retried across members: the compares make a double application impossible.
            reply = await self.client.txn(
                [cmp_create(self.parent.leader_key, self.term.revision), cmp_mod(key, self.revs.get(g, 0))],
                ops, [op_get(self.parent.leader_key), op_get(key)], what=f"the commit of group {g!r}", retry=True)
        except Unavailable as exc:
            self.term.end(f"commit of group {g!r} failed: {exc}")
            if new is not old and new is not None:
                self._spawn(self.client.lease_revoke(new.lease))
            raise
        revision = reply.header.revision
        if not reply.succeeded:
            revision = self._applied_earlier(reply, value)
        if not revision:
            why = (f"etcd refused the commit of group {g!r}: this replica's leadership (term "
                   f"{self.term.revision}) ended or another writer changed the group")
            self.term.end(why)
            if new is not old and new is not None:
                self._spawn(self.client.lease_revoke(new.lease))
            raise Unavailable(f"{why}; retry against the current leader", group_id=g)
        self.revs[g] = revision
        if new is not old:
            if old is not None:
                self.keeper.drop(old.lease)
                self._spawn(self.client.lease_revoke(old.lease))
            if new is not None:
                self.turns[g] = new
                self.keeper.keep(new.lease, self.turn_ttl, None)
            else:
                self.turns.pop(g, None)

    def _applied_earlier(self, reply: Any, value: bytes) -> int:
        """After a refused retry: the group's revision if an earlier try of this very
        commit was applied (its reply lost), else 0."""
        leader, group = (r.response_range.kvs for r in reply.responses)
        if leader and leader[0].create_revision == self.term.revision and group and group[0].value == value:
            return group[0].mod_revision
        return 0

    # ------------------------------------------------------------- extras

    async def verify(self, group_id: str) -> None:
        """Prove (one linearizable round trip) that this term still leads and the group
        is as this term last wrote it; else end the term and raise Unavailable."""
        self._check_term(group_id)
        key = self.parent.group_key(group_id)
        try:
            reply = await self.client.txn([cmp_create(self.parent.leader_key, self.term.revision),
                                           cmp_mod(key, self.revs.get(group_id, 0))], [],
                                          what=f"the leadership check for group {group_id!r}", retry=True)
        except Unavailable as exc:
            self.term.end(f"leadership check failed: {exc}")
            raise
        if not reply.succeeded:
            self.term.end("leadership check refused by etcd")
            raise Unavailable(f"group {group_id!r}: this replica no longer leads (term {self.term.revision}); "
                              "retry against the current leader", group_id=group_id)

    async def _restore_turn(self, group_id: str, job: str, token: int) -> None:
        lease, _ = await self.client.lease_grant(self.turn_ttl)
        reply = await self.client.txn(
            [cmp_create(self.parent.leader_key, self.term.revision)],
            [op_put(self.parent.turn_key(group_id), _turn_value(job, token), lease)],
            what=f"the turn lease of group {group_id!r}", retry=True)
        if not reply.succeeded:
            self.term.end("leadership lost while restoring turn leases")
            raise Unavailable("leadership lost while restoring turn leases", group_id=group_id)
        self.turns[group_id] = Turn(job, token, lease)
        self.keeper.keep(lease, self.turn_ttl, None)

    def keep_turn(self, group_id: str, alive: bool) -> None:
        """Refresh the holder's turn lease while ``alive``; stop (let it expire) if not."""
        turn = self.turns.get(group_id)
        if turn is None:
            return
        if alive:
            self.keeper.keep(turn.lease, self.turn_ttl, None)
        else:
            self.keeper.drop(turn.lease)

    def watch_turns(self, on_expired: Callable[[str, str, int], Awaitable[None]]) -> None:
        """Call ``on_expired(group, job, token)`` when a turn key vanishes (lease expiry,
        or this term's own release: the callback checks the token)."""

        async def on_events(events: list, revision: int) -> None:
            for ev in events:
                if ev.type != ev.DELETE or not ev.prev_kv.value:
                    continue
                group = ev.kv.key.decode().rsplit("/", 1)[1]
                try:
                    d = json.loads(ev.prev_kv.value)
                    await on_expired(group, d["job"], int(d["token"]))
                except (ValueError, KeyError, TypeError) as exc:
                    log.error("unreadable turn key %s: %s", ev.kv.key.decode(), exc)

        self._watch = Watch(self.client, self.parent.turns_prefix, self.revision + 1, on_events)

    async def close(self) -> None:
        """End of term: stop watching and refreshing (leases stay for the next leader)."""
        if self._watch is not None:
            await self._watch.cancel()
        for turn in self.turns.values():
            self.keeper.drop(turn.lease)
        for task in list(self._background):
            task.cancel()

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
