"""Who may hold the HTTP front end's connections, and how fast a wrong API key may be tried.

One global connection cap let one unauthenticated client holding ~2,100 sockets get every
tenant 503. The gate bounds connections where they come from, before any key is known:

* **per client**: one peer address holds at most ``per_client`` open connections (past it a
  new one is closed at once);
* **unauthenticated**: connections that have not yet shown a known API key hold at most
  ``unauthenticated`` places in all; one more evicts the oldest of them. A keyed client's
  new connection shows its key in its first request head, within milliseconds, and is then
  no longer evictable; a slow client's connections are the ones that go. (The server's
  global cap is larger than this, so unauthenticated connections alone never reach it.)
* **per key**: connections that have shown one tenant's API key hold at most ``per_key``
  places; one more is closed as soon as its request head shows the key. A tenant that holds
  thousands of requests whose bodies never come (each waits out the body deadline), from as
  many addresses as it likes, keeps only its own requests out.
* **failed keys** are logged (the peer address and how many in the last minute; never the
  key) and slowed: the refusal waits ``FAIL_DELAY_S`` doubled per failure of that peer in
  the last minute, up to ``FAIL_DELAY_MAX_S``, while its connection counts against the
  peer's cap, so a peer tries a few keys a second, not thousands;
* **service-wide**, beside the per-peer count: 200 loopback addresses once guessed 100 keys a
  second, each peer's own count staying low. Every failure also counts in one budget of the
  whole service: past :data:`SERVICE_FREE_FAILURES` in the last minute the refusal waits
  ``FAIL_DELAY_S`` doubled per further :data:`SERVICE_FAILURE_STEP` failures (up to
  ``FAIL_DELAY_MAX_S``), whichever peer they came from; a known key is never slowed.

Lives on the server's event loop (no locks); used by :mod:`rota_tinker._http.server`.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

log = logging.getLogger(__name__)

FAIL_WINDOW_S = 60.0
FAIL_DELAY_S = 0.05
FAIL_DELAY_MAX_S = 5.0
MAX_PEERS_TRACKED = 65536  # peers with recent failures remembered (oldest forgotten first)
SERVICE_FREE_FAILURES = 16  # failures a minute, all peers together, before the service-wide budget slows refusals
SERVICE_FAILURE_STEP = 4  # ... and the delay doubles every this many failures more


class Gate:
    """Connection places by peer and by authentication; failed-key pacing (see the module docs)."""

    def __init__(self, per_client: int, unauthenticated: int, per_key: int | None = None) -> None:
        self.per_client, self.unauthenticated = per_client, unauthenticated
        self.per_key = per_key or unauthenticated
        self._by_key: collections.Counter[bytes] = collections.Counter()
        self._key_of: dict[Any, bytes] = {}  # keyed connection -> the key it showed last
        self._by_peer: collections.Counter[str] = collections.Counter()
        self._pending: collections.OrderedDict[Any, Any] = collections.OrderedDict()  # protocol -> its transport
        self._failures: collections.OrderedDict[str, collections.deque[float]] = collections.OrderedDict()
        self._all_failures: collections.deque[float] = collections.deque()  # every peer's, the last minute

    def admit(self, conn: Any, transport: Any, peer: str) -> bool:
        """Whether connection ``conn`` from ``peer`` may stay open; it then counts as unauthenticated."""
        if self._by_peer[peer] >= self.per_client:
            log.warning("closing a connection from %s: it already holds %d (--max-client-connections)", peer,
                        self.per_client)
            return False
        self._by_peer[peer] += 1
        self._pending[conn] = transport
        while len(self._pending) > self.unauthenticated:
            _, oldest = self._pending.popitem(last=False)
            log.info("closing the oldest connection that has shown no API key (over %d such connections, "
                     "--max-unauthenticated)", self.unauthenticated)
            oldest.close()
        return True

    def keyed(self, conn: Any, key: bytes) -> bool:
        """``conn`` showed the known API ``key``: whether it keeps its place (False: that key holds ``per_key``
        connections already; close it)."""
        self._pending.pop(conn, None)
        if self._key_of.get(conn) == key:
            return True
        self._drop_key(conn)
        if self._by_key[key] >= self.per_key:
            log.warning("closing a connection whose API key already holds %d open connections "
                        "(--max-key-connections)", self.per_key)  # never the key itself
            return False
        self._by_key[key] += 1
        self._key_of[conn] = key
        return True

    def left(self, conn: Any, peer: str) -> None:
        self._pending.pop(conn, None)
        self._drop_key(conn)
        self._by_peer[peer] -= 1
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]

    def _drop_key(self, conn: Any) -> None:
        key = self._key_of.pop(conn, None)
        if key is not None:
            self._by_key[key] -= 1
            if self._by_key[key] <= 0:
                del self._by_key[key]

    def failed(self, peer: str) -> float:
        """Record a wrong API key from ``peer`` (logged); the seconds its refusal waits."""
        now = time.monotonic()
        times = self._failures.pop(peer, None) or collections.deque()
        while times and now - times[0] > FAIL_WINDOW_S:
            times.popleft()
        times.append(now)
        self._failures[peer] = times
        while len(self._failures) > MAX_PEERS_TRACKED:
            self._failures.popitem(last=False)
        every = self._all_failures
        while every and now - every[0] > FAIL_WINDOW_S:
            every.popleft()
        every.append(now)
        n, total = len(times), len(every)
        log.warning("unknown API key from %s (%d in the last %g s; %d from all peers)", peer, n, FAIL_WINDOW_S,
                    total)
        over = max(0, total - SERVICE_FREE_FAILURES)
        service = FAIL_DELAY_S * 2 ** min(over // SERVICE_FAILURE_STEP, 20) if over else 0.0
        return min(max(FAIL_DELAY_S * 2 ** min(n - 1, 20), service), FAIL_DELAY_MAX_S)


__all__ = ["Gate"]
