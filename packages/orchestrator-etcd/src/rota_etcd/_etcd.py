"""The only module that talks to etcd: a small asyncio client over etcd's v3 gRPC API.

No etcd client library does what an orchestrator needs by itself, so this one does it
here and nowhere else: calls fail over across every endpoint given, a lease keeper
runs the keepalive stream (and says when a lease is gone), and a watch re-creates
its stream from the last revision seen + 1 when it breaks. The protobuf messages and
stubs come from ``aetcd`` (``aetcd.rpc``), whose own client is not used.

Every failure reaches callers as :class:`rota.errors.Unavailable` naming the
endpoints, so the orchestrator answers UNAVAILABLE and never grants on a failed write.

Used by :mod:`rota_etcd._store` (state, turn leases) and :mod:`rota_etcd._election`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
from aetcd import rpc

from rota.auth import read_pem
from rota.errors import ConfigError, Unavailable

log = logging.getLogger(__name__)

# Channel options: reconnect quickly after a member comes back (gRPC's default backoff
# grows to two minutes), and notice a dead peer within seconds.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 5000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
)
# Streams carry this so a member cut off from its cluster's leader ends them instead of
# going silent (etcd's WithRequireLeader).
_REQUIRE_LEADER = (("hasleader", "true"),)


def parse_endpoints(url: str) -> list[str]:
    """``"http://a:2379,b:2379"`` -> ``["a:2379", "b:2379"]``; ConfigError on bad input."""
    return [ep for ep, _ in _parse(url)]


def uses_tls(url: str) -> bool:
    """True for ``https://`` members (then all of them must be); ConfigError when they are mixed."""
    schemes = {tls for _, tls in _parse(url)}
    if len(schemes) > 1:
        raise ConfigError(f"--etcd {url!r} mixes http:// and https:// members; a cluster speaks one of them")
    return schemes == {True}


def _parse(url: str) -> list[tuple[str, bool]]:
    out = []
    for part in (p.strip() for p in str(url).split(",")):
        if not part:
            continue
        raw = part if "://" in part else f"http://{part}"
        try:
            u = urlsplit(raw)
            port = u.port or 2379
        except ValueError:
            u, port = None, 0
        if u is None or u.scheme not in ("http", "https", "etcd") or not u.hostname or (u.path not in ("", "/")):
            raise ConfigError(f"--etcd {url!r}: {part!r} is not an etcd client URL; write http://HOST:PORT or "
                              "https://HOST:PORT (comma-separated for several members)")
        host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
        out.append((f"{host}:{port}", u.scheme == "https"))
    if not out:
        raise ConfigError(f"--etcd {url!r} names no endpoint; write e.g. http://127.0.0.1:2379")
    return out


def tls_credentials(url: str) -> grpc.ChannelCredentials | None:
    """Client TLS for ``https://`` members from ROTA_ETCD_CA (the cluster's CA) and, when etcd checks client
    certificates, ROTA_ETCD_CERT + ROTA_ETCD_KEY (PEM files). None for http://."""
    ca, cert, key = (os.environ.get(f"ROTA_ETCD_{k}", "") for k in ("CA", "CERT", "KEY"))
    if not uses_tls(url):
        if ca or cert or key:
            raise ConfigError(f"ROTA_ETCD_CA/CERT/KEY are set but --etcd {url!r} is http://; use https:// URLs")
        return None
    if not ca:
        raise ConfigError(f"--etcd {url!r} is https:// but ROTA_ETCD_CA is not set; point it at the cluster's CA "
                          "certificate (PEM)")
    if bool(cert) != bool(key):
        raise ConfigError("set both ROTA_ETCD_CERT and ROTA_ETCD_KEY (the client certificate and its key), or neither")

    return grpc.ssl_channel_credentials(root_certificates=read_pem(ca, "ROTA_ETCD_CA"),
                                        private_key=read_pem(key, "ROTA_ETCD_KEY") if key else None,
                                        certificate_chain=read_pem(cert, "ROTA_ETCD_CERT") if cert else None)


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``."""
    return prefix[:-1] + bytes([prefix[-1] + 1])


# ------------------------------------------------------------ request helpers


def cmp_create(key: bytes, revision: int) -> rpc.Compare:
    """Compare: ``key`` was created at ``revision`` (0 = ``key`` does not exist)."""
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=revision)


def cmp_mod(key: bytes, revision: int) -> rpc.Compare:
    """Compare: ``key`` was last written at ``revision`` (0 = ``key`` does not exist)."""
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def op_put(key: bytes, value: bytes, lease: int = 0) -> rpc.RequestOp:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def op_delete(key: bytes) -> rpc.RequestOp:
    return rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key))


def op_get(key: bytes, *, prefix: bool = False) -> rpc.RequestOp:
    return rpc.RequestOp(request_range=rpc.RangeRequest(key=key, range_end=prefix_end(key) if prefix else b""))


# ------------------------------------------------------------------- client


class EtcdClient:
    """Calls to an etcd cluster through any of its members.

    Unary calls go to the current member; when one fails with a connection-level
    error the client moves to the next member. Reads and lease calls are retried
    there until ``timeout``; writes only when the caller says a retry is safe.
    """

    def __init__(self, endpoints: Sequence[str], *, timeout: float = 2.0,
                 tls: grpc.ChannelCredentials | None = None) -> None:
        if not endpoints:
            raise ConfigError("no etcd endpoint given")
        self.endpoints = list(endpoints)
        self.timeout = timeout
        self.tls = tls
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._current = 0
        self._closed = False

    def describe(self) -> str:
        scheme = "https" if self.tls is not None else "http"
        return ", ".join(f"{scheme}://{e}" for e in self.endpoints)

    # ------------------------------------------------------------- plumbing

    def channel(self, index: int | None = None) -> grpc.aio.Channel:
        ep = self.endpoints[self._current if index is None else index % len(self.endpoints)]
        ch = self._channels.get(ep)
        if ch is None:
            if self.tls is not None:
                ch = grpc.aio.secure_channel(ep, self.tls, options=_CHANNEL_OPTIONS)
            else:
                ch = grpc.aio.insecure_channel(ep, options=_CHANNEL_OPTIONS)
            self._channels[ep] = ch
        return ch

    def rotate(self) -> None:
        """Use the next member for the following calls (after a failure)."""
        self._current = (self._current + 1) % len(self.endpoints)

    def _unavailable(self, what: str, exc: BaseException) -> Unavailable:
        detail = exc.details() if isinstance(exc, grpc.RpcError) and hasattr(exc, "details") else str(exc)
        detail = detail or type(exc).__name__
        return Unavailable(f"etcd ({self.describe()}) did not complete {what}: {detail}; "
                           "no grant is made until etcd answers again", delay=0.5)

    async def _unary(self, what: str, call: Callable[[grpc.aio.Channel], Awaitable[Any]], *,
                     retry: bool, timeout: float | None = None) -> Any:
        if self._closed:
            raise Unavailable(f"etcd client for {self.describe()} is closed")
        deadline = time.monotonic() + (timeout or self.timeout)
        last: BaseException | None = None
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._unavailable(what, last or TimeoutError("timed out"))
            try:
                return await asyncio.wait_for(call(self.channel()), remaining)
            except (grpc.RpcError, asyncio.TimeoutError) as exc:
                last = exc
                code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED):
                    raise self._unavailable(what, exc) from None
                self.rotate()
                if not retry:
                    raise self._unavailable(what, exc) from None
                await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    # ------------------------------------------------------------- KV calls

    async def get(self, key: bytes, *, prefix: bool = False, timeout: float | None = None) -> rpc.RangeResponse:
        """Linearizable read of ``key`` (or every key under it with ``prefix``)."""
        req = rpc.RangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        return await self._unary(f"a read of {key.decode()!r}",
                                 lambda ch: rpc.KVStub(ch).Range(req), retry=True, timeout=timeout)

    async def put(self, key: bytes, value: bytes, *, lease: int = 0) -> rpc.PutResponse:
        req = rpc.PutRequest(key=key, value=value, lease=lease)
        return await self._unary(f"a write of {key.decode()!r}", lambda ch: rpc.KVStub(ch).Put(req), retry=False)

    async def delete(self, key: bytes, *, prefix: bool = False) -> rpc.DeleteRangeResponse:
        req = rpc.DeleteRangeRequest(key=key, range_end=prefix_end(key) if prefix else b"")
        return await self._unary(f"a delete of {key.decode()!r}",
                                 lambda ch: rpc.KVStub(ch).DeleteRange(req), retry=False)

    async def txn(self, compare: Sequence[rpc.Compare], success: Sequence[rpc.RequestOp],
                  failure: Sequence[rpc.RequestOp] = (), *, what: str = "a transaction",
                  retry: bool = False) -> rpc.TxnResponse:
        """One etcd transaction: ``success`` ops if every compare holds, else ``failure`` ops.

        ``retry=True`` re-sends it on the next member after a connection failure. Only
        safe for transactions whose compares make a second application impossible; the
        caller must then tell "applied by an earlier try" from "refused" itself.
        """
        req = rpc.TxnRequest(compare=list(compare), success=list(success), failure=list(failure))
        return await self._unary(what, lambda ch: rpc.KVStub(ch).Txn(req), retry=retry)

    async def status(self, timeout: float | None = None) -> rpc.StatusResponse:
        """Status of the current member (fails over like a read)."""
        return await self._unary("a status check", lambda ch: rpc.MaintenanceStub(ch).Status(rpc.StatusRequest()),
                                 retry=True, timeout=timeout)

    # ---------------------------------------------------------- lease calls

    async def lease_grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease; returns (id, granted TTL). An unused lease simply expires."""
        reply = await self._unary("a lease grant", lambda ch: rpc.LeaseStub(ch).LeaseGrant(
            rpc.LeaseGrantRequest(TTL=int(ttl_s))), retry=True)
        if reply.error:
            raise Unavailable(f"etcd ({self.describe()}) refused a lease: {reply.error}")
        return reply.ID, reply.TTL

    async def lease_revoke(self, lease_id: int) -> None:
        """Revoke a lease (its keys are deleted). A lease already gone is not an error."""
        try:
            await self._unary("a lease revoke", lambda ch: rpc.LeaseStub(ch).LeaseRevoke(
                rpc.LeaseRevokeRequest(ID=lease_id)), retry=True)
        except Unavailable as exc:
            if "not found" not in str(exc):
                raise

    async def lease_ttl(self, lease_id: int) -> int:
        """Seconds left on a lease (-1 if it is gone)."""
        reply = await self._unary("a lease lookup", lambda ch: rpc.LeaseStub(ch).LeaseTimeToLive(
            rpc.LeaseTimeToLiveRequest(ID=lease_id)), retry=True)
        return reply.TTL

    async def close(self) -> None:
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            with contextlib.suppress(Exception):
                await ch.close(grace=None)


# ------------------------------------------------------------- lease keeper


@dataclass
class _Kept:
    ttl_s: float
    on_lost: Callable[[int], None] | None
    confirmed: float  # monotonic time of the send whose reply confirmed the lease
    sent: float = 0.0


class LeaseKeeper:
    """Keeps leases alive over one ``LeaseKeepAlive`` stream, reconnecting as needed.

    Each lease is refreshed every third of its TTL. ``valid_until(id)`` is a
    conservative deadline: the send time of the last confirmed refresh plus the TTL,
    so a holder that trusts it never outlives its lease in etcd. A lease that etcd
    reports gone (TTL 0) is dropped and its ``on_lost`` callback runs. A stream that
    answers no refresh for a third of the shortest TTL (a member stopped or cut off keeps
    its connection open) is re-opened on the next member.
    """

    def __init__(self, client: EtcdClient) -> None:
        self.client = client
        self._leases: dict[int, _Kept] = {}
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()

    def keep(self, lease_id: int, ttl_s: float, on_lost: Callable[[int], None] | None = None, *,
             fresh: bool = True) -> None:
        """Refresh ``lease_id`` from now on; ``on_lost`` replaces any earlier callback.

        ``fresh`` says the caller just had the lease from etcd (a grant), so it counts as
        confirmed now; a lease kept again after a ``drop`` is not (it may have expired
        meanwhile) and stays unconfirmed until etcd answers its first refresh."""
        kept = self._leases.get(lease_id)
        if kept is None:
            self._leases[lease_id] = _Kept(ttl_s, on_lost, time.monotonic() if fresh else 0.0)
            self._wake.set()
        else:
            kept.on_lost = on_lost
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="rota-etcd-lease-keeper")

    def drop(self, lease_id: int) -> None:
        self._leases.pop(lease_id, None)

    def kept(self) -> set[int]:
        return set(self._leases)

    def valid_until(self, lease_id: int) -> float:
        k = self._leases.get(lease_id)
        return k.confirmed + k.ttl_s if k else 0.0

    async def stop(self) -> None:
        self._leases.clear()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    async def _run(self) -> None:
        while self._leases:
            try:
                await self._stream()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a broken stream is re-opened on the next member
                log.info("etcd lease keepalive stream broke (%s); reconnecting", exc)
                self.client.rotate()
                await asyncio.sleep(0.1)

    def _stall_s(self) -> float:
        """How long an unanswered refresh may wait before the stream counts as stuck:
        a third of the shortest TTL (one missed refresh round), at least a second."""
        return max(1.0, min((k.ttl_s for k in self._leases.values()), default=3.0) / 3)

    async def _stream(self) -> None:
        call = rpc.LeaseStub(self.client.channel()).LeaseKeepAlive(metadata=_REQUIRE_LEADER)
        pending: deque[tuple[int, float]] = deque()

        async def reader() -> None:
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("keepalive stream ended")
                while pending and pending[0][0] != reply.ID:
                    pending.popleft()
                sent = pending.popleft()[1] if pending else time.monotonic()
                kept = self._leases.get(reply.ID)
                if kept is None:
                    continue
                if reply.TTL <= 0:
                    self._leases.pop(reply.ID, None)
                    log.warning("etcd lease %x is gone", reply.ID)
                    if kept.on_lost:
                        kept.on_lost(reply.ID)
                else:
                    kept.confirmed = max(kept.confirmed, sent)

        for kept in self._leases.values():
            kept.sent = 0.0  # what the last stream sent may never have arrived: refresh all at once
        read_task = asyncio.create_task(reader())
        try:
            while self._leases:
                now = time.monotonic()
                for lease_id, kept in list(self._leases.items()):
                    if now - kept.sent >= kept.ttl_s / 3:
                        kept.sent = now
                        pending.append((lease_id, now))
                        await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
                if read_task.done():
                    read_task.result()  # raises what broke the stream
                if pending and now - pending[0][1] > self._stall_s():
                    # a member that is stopped or cut off keeps the connection open and answers nothing
                    raise ConnectionError(f"no lease refresh answered for {now - pending[0][1]:.1f} s")
                self._wake.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), 0.1)
        finally:
            read_task.cancel()
            call.cancel()


# ------------------------------------------------------------------ watches


class Watch:
    """Watch every key under ``prefix`` (or exactly that key) from ``start_revision``.

    The stream is re-created from the last revision delivered + 1 whenever it breaks
    (member down, member without leader), on the next member. If etcd compacted the
    revisions needed, ``on_compacted`` runs and the watch restarts from the present.
    ``deletes_only``: etcd leaves puts out of the stream.
    """

    def __init__(self, client: EtcdClient, prefix: bytes, start_revision: int,
                 on_events: Callable[[list[rpc.Event], int], Awaitable[None]],
                 on_compacted: Callable[[], Awaitable[None]] | None = None, *, exact: bool = False,
                 deletes_only: bool = False) -> None:
        self.client, self.prefix, self.next_revision = client, prefix, start_revision
        self.filters = [rpc.WatchCreateRequest.NOPUT] if deletes_only else []
        self.on_events, self.on_compacted = on_events, on_compacted
        self.range_end = b"" if exact else prefix_end(prefix)
        self._task = asyncio.create_task(self._run(), name=f"rota-etcd-watch-{prefix.decode()}")

    async def cancel(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self._stream()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.info("etcd watch on %s broke (%s); re-creating from revision %d",
                         self.prefix.decode(), exc, self.next_revision)
                self.client.rotate()
                await asyncio.sleep(0.1)

    async def _stream(self) -> None:
        call = rpc.WatchStub(self.client.channel()).Watch(metadata=_REQUIRE_LEADER)
        try:
            await call.write(rpc.WatchRequest(create_request=rpc.WatchCreateRequest(
                key=self.prefix, range_end=self.range_end, start_revision=self.next_revision,
                prev_kv=True, filters=self.filters)))
            while True:
                reply = await call.read()
                if reply is grpc.aio.EOF:
                    raise ConnectionError("watch stream ended")
                if reply.compact_revision:
                    log.warning("etcd compacted revisions of %s below %d; resynchronising",
                                self.prefix.decode(), reply.compact_revision)
                    self.next_revision = reply.compact_revision
                    if self.on_compacted:
                        await self.on_compacted()
                    raise ConnectionError("watch compacted")
                if reply.canceled:
                    raise ConnectionError(f"watch cancelled: {reply.cancel_reason or 'no reason given'}")
                if reply.events:
                    self.next_revision = reply.events[-1].kv.mod_revision + 1
                    await self.on_events(list(reply.events), reply.header.revision)
        finally:
            call.cancel()
