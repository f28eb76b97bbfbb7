"""The audit log: what each tenant did to its checkpoints and projects, as ``RestClient.get_audit_log`` /
``AdminClient.get_audit_log`` read it (``GET /api/v1/audit?event_type=...&day=YYYY-MM-DD``).

Events are ``checkpoint_create``, ``checkpoint_read`` (loaded, archived, external URLs signed,
copied from; ``purpose`` says which), ``checkpoint_delete``, ``checkpoint_expire``,
``checkpoint_publish``, ``checkpoint_unpublish``, ``checkpoint_ttl_set`` and
``project_session_assign``; each names the tenant that acted (``actor``) and what it acted on. A
tenant reads its own events only (this service has no organisation admins). Kept in memory, the
newest :data:`MAX_EVENTS` per tenant; a restart starts an empty log.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import parse_qs

from rota_tinker._http.formats import BadRequest
from rota_tinker._http.server import Reply

MAX_EVENTS = 10_000
EVENT_TYPES = {"all": "", "checkpoints": "checkpoint_", "projects": "project_", "teams": None, "organizations": None}


class AuditLog:
    """Each tenant's newest events: (wall time, event, details)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: dict[str, deque[tuple[float, str, dict[str, Any]]]] = {}

    def note(self, tenant: str, event: str, **details: Any) -> None:
        with self._lock:
            self._events.setdefault(tenant, deque(maxlen=MAX_EVENTS)).append(
                (time.time(), event, {"actor": tenant, **details}))

    def of(self, tenant: str, prefix: str | None, start: float, end: float) -> list[tuple[float, str, dict[str, Any]]]:
        with self._lock:
            events = list(self._events.get(tenant, ()))
        if prefix is None:
            return []
        return [e for e in events if start <= e[0] < end and e[1].startswith(prefix)]


class AuditRoutes:
    """``GET /api/v1/audit`` of :class:`rota_tinker._http.service._Api`."""

    state: Any

    def _audit_log(self, tenant: Any, query: str) -> Reply:
        args = parse_qs(query, max_num_fields=4)
        kind = args.get("event_type", ["all"])[0]
        if kind not in EVENT_TYPES:
            raise BadRequest(f"event_type {kind[:40]!r} is not one of {sorted(EVENT_TYPES)}")
        try:
            day = datetime.date.fromisoformat(args["day"][0]) if "day" in args else datetime.datetime.now(
                datetime.timezone.utc).date()
        except ValueError:
            raise BadRequest("day must be a date, YYYY-MM-DD") from None
        start = datetime.datetime.combine(day, datetime.time(), datetime.timezone.utc).timestamp()
        entries = []
        for when, event, details in self.state.runs.audit.of(tenant.name, EVENT_TYPES[kind], start, start + 86400):
            entries.append({"timestamp": datetime.datetime.fromtimestamp(when, datetime.timezone.utc).isoformat(),
                            "event": event, "event_details": details, "tinker_path": details.get("tinker_path"),
                            "model_id": details.get("model_id"), "purpose": details.get("purpose")})
        return Reply.json({"entries": entries})


ROUTES = {"/api/v1/audit": ("GET", AuditRoutes._audit_log)}
WITH_QUERY = (AuditRoutes._audit_log,)
