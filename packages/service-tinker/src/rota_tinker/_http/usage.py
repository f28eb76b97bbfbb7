"""Usage by the hour: what ``RestClient/AdminClient.get_billing_usage`` reads
(``GET /api/v1/billing/usage/events?starting_on=...&ending_before=...``), without prices.

Counted when a unit succeeds, per tenant, UTC hour, base model, session and kind: ``training``
(the tokens of each ``forward``/``forward_backward`` datum), ``sampling_prefill`` (a sample
request's prompt tokens, once however many samples; never ``cached``: this service keeps no
prefix cache), ``sampling_sample`` (the tokens sampled) and ``checkpoint`` (each named
checkpoint saved). Storage is the storage usage route's (``get_current_checkpoint_storage_usage``),
not GB-hours here. Costs and rates are None: this service has no rate card. A tenant reads its
own usage only; in memory, the newest :data:`MAX_BUCKETS` buckets per tenant.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import OrderedDict
from typing import Any
from urllib.parse import parse_qs

from rota_tinker._http.formats import BadRequest
from rota_tinker._http.server import Reply

MAX_BUCKETS = 100_000
MAX_WINDOW_S = 14 * 86400  # the SDK's documented longest window
_FIELD = {"training": "token_count", "sampling_prefill": "token_count", "sampling_sample": "token_count",
          "checkpoint": "count"}


class Usage:
    """Counts per (tenant, hour, base, session, kind)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[str, OrderedDict[tuple[int, str, str | None, str], int]] = {}

    def note(self, tenant: str, kind: str, n: int, base: str, session: str | None) -> None:
        if n <= 0:
            return
        key = (int(time.time() // 3600) * 3600, base, session, kind)
        with self._lock:
            mine = self._counts.setdefault(tenant, OrderedDict())
            mine[key] = mine.get(key, 0) + n
            mine.move_to_end(key)
            while len(mine) > MAX_BUCKETS:
                mine.popitem(last=False)

    def of(self, tenant: str, start: float, end: float) -> list[tuple[tuple[int, str, str | None, str], int]]:
        with self._lock:
            items = list(self._counts.get(tenant, {}).items())
        return [(k, n) for k, n in items if start <= k[0] < end]


def _when(args: dict[str, list[str]], name: str) -> float:
    try:
        t = datetime.datetime.fromisoformat(args[name][0])
    except (KeyError, ValueError):
        raise BadRequest(f"{name} must be an ISO 8601 time (a UTC hour boundary)") from None
    return (t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)).timestamp()


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


class UsageRoutes:
    """``GET /api/v1/billing/usage/events`` of :class:`rota_tinker._http.service._Api`."""

    state: Any

    def _billing_usage(self, tenant: Any, query: str) -> Reply:
        args = parse_qs(query, max_num_fields=4)
        start, end = _when(args, "starting_on"), _when(args, "ending_before")
        if not 0 < end - start <= MAX_WINDOW_S:
            raise BadRequest("ending_before must come after starting_on, at most 14 days later")
        rows = sorted(self.state.usage_counts.of(tenant.name, start, end), key=lambda kn: (kn[0][0], -kn[1]))
        with self.state.lock:
            sessions = {s.session_id: s for s in self.state.sessions.values() if s.tenant == tenant.name}
        data = []
        for (hour, base, session, kind), n in rows:
            info: dict[str, Any] = {"type": kind, _FIELD[kind]: n}
            if kind == "sampling_prefill":
                info["cached"] = False
            s = sessions.get(session) if session else None
            data.append({"bucket_start": _iso(hour), "bucket_end": _iso(hour + 3600), "base_model": base,
                         "user_name": tenant.name, "session_id": session,
                         "project_id": s.project_id if s is not None else None, "event_info": info})
        seen = {row["session_id"] for row in data if row["session_id"]}
        return Reply.json({"data": data, "sessions": {
            sid: {"user_metadata": sessions[sid].user_metadata if sid in sessions else None} for sid in seen}})


ROUTES = {"/api/v1/billing/usage/events": ("GET", UsageRoutes._billing_usage)}
WITH_QUERY = (UsageRoutes._billing_usage,)
