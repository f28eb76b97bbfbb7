"""What one API key may have in flight: work units queued or running, and the bytes of results the HTTP process
holds for it.

Why: one key once queued a backlog that held every other tenant's step for seconds, and left maximal sample
results unfetched (about 1 GiB each in this process, kept 900 s): nothing bounded either per key. Here:

* **queued units**: a key has at most ``max_queued_units`` work units that have not finished (queued in a worker's
  pipe or queue, or running); one more is refused (429, as a failed future the SDK raises at once);
* **result bytes**: a unit reserves, when it is accepted, the most bytes its result can take (a sample's from its
  samples, tokens and top-k asked for; see :func:`rota_tinker._http.sampling.result_bound`); once it finishes, its
  encoded result's real size counts instead, until the result is dropped: ``result_grace_s`` after its first
  answer (a client whose connection broke may fetch it again meanwhile), or ``future_ttl_s`` after it finished
  if nobody fetches it. A key past ``max_result_bytes`` has its next units refused (429) until it fetches some; a
  single unit whose result could take more than that is refused (400) naming how to ask for less.

Used by :class:`rota_tinker._http.state._State` (its own lock: futures' callbacks call it).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from rota_tinker._http.formats import BadRequest, QuotaExceeded

log = logging.getLogger(__name__)

JSON_RESULT_BYTES = 4096  # what a JSON result (create_model, optim_step, saves) reserves
HELD_JSON_BYTES = 1024  # and counts once it is there


class Budget:
    """Per-key queued units and result bytes (see the module docs)."""

    def __init__(self, max_units: int, max_bytes: int, grace_s: float) -> None:
        self.max_units, self.max_bytes, self.grace_s = max_units, max_bytes, grace_s
        self._lock = threading.Lock()
        self.queued: collections.Counter[str] = collections.Counter()  # key -> units not finished
        self.held: collections.Counter[str] = collections.Counter()  # key -> result bytes reserved or held
        self._counted: dict[str, tuple[str, int]] = {}  # request id -> (key, bytes it counts now)
        self._delivered: collections.deque[tuple[float, Any]] = collections.deque()  # (drop at, future)

    def admit(self, tenant: str, fut: Any, result_bytes: int) -> None:
        """Count a new unit of ``tenant`` whose result may take ``result_bytes``.

        :raises BadRequest: one result could take more than ``max_result_bytes`` (400).
        :raises QuotaExceeded: the key has ``max_queued_units`` unfinished units, or results past its bytes (429).
        """
        if result_bytes > self.max_bytes:
            raise BadRequest(f"this request's result could take {result_bytes} bytes, more than one API key may hold "
                             f"(max_result_bytes={self.max_bytes}); ask for fewer samples, tokens or top-k logprobs "
                             "per request")
        self.prune()
        with self._lock:
            if self.queued[tenant] >= self.max_units:
                raise QuotaExceeded(f"tenant {tenant} has {self.queued[tenant]} requests queued or running, the most "
                                    f"one API key may (max_queued_units={self.max_units}); wait for some to finish")
            if self.held[tenant] + result_bytes > self.max_bytes:
                raise QuotaExceeded(f"tenant {tenant} has {self.held[tenant]} bytes of results reserved or not yet "
                                    f"fetched; this request's could take {result_bytes} more, past max_result_bytes="
                                    f"{self.max_bytes}: fetch the results of earlier requests (retrieve_future) first "
                                    f"(a fetched result is let go {self.grace_s:g} s after its first answer)")
            self.queued[tenant] += 1
            self.held[tenant] += result_bytes
            self._counted[fut.request_id] = (tenant, result_bytes)

    def finished(self, fut: Any) -> None:
        """``fut`` is done: it is no longer queued, and its result counts its real size (a failure: nothing)."""
        size = len(fut.proto) if fut.proto is not None else HELD_JSON_BYTES if fut.json is not None else 0
        with self._lock:
            entry = self._counted.get(fut.request_id)
            if entry is None:
                return
            tenant, counted = entry
            if size > counted:  # the bound missed something: the real size counts all the same
                log.warning("%s %s: result of %d bytes, %d reserved", fut.kind, fut.request_id, size, counted)
            self.queued[tenant] -= 1
            self.held[tenant] += size - counted
            self._counted[fut.request_id] = (tenant, size)

    def delivered(self, fut: Any) -> None:
        """``fut``'s result was answered: it is let go ``grace_s`` from now."""
        with self._lock:
            if fut.request_id in self._counted and not getattr(fut, "delivered", False):
                fut.delivered = True
                self._delivered.append((time.monotonic() + self.grace_s, fut))

    def prune(self) -> None:
        """Let go the results answered more than ``grace_s`` ago."""
        now = time.monotonic()
        with self._lock:
            while self._delivered and self._delivered[0][0] <= now:
                _, fut = self._delivered.popleft()
                self._drop(fut)

    def forget(self, fut: Any) -> None:
        """``fut`` is forgotten (``future_ttl_s`` after it finished): its result goes with it."""
        with self._lock:
            self._drop(fut)

    def _drop(self, fut: Any) -> None:
        entry = self._counted.pop(fut.request_id, None)
        if entry is None:
            return
        tenant, counted = entry
        self.held[tenant] -= counted
        fut.drop_result()
        for table in (self.held, self.queued):
            if tenant in table and table[tenant] <= 0:
                del table[tenant]
