"""Session traces: ``RestClient.export_session_trace`` (``GET /api/v1/sessions/{id}/trace_export``).

The owner gets ``{"status": "ready", "url": ...}`` at once: a URL on this service, signed like
external weights' (an HMAC over owner, session and expiry, 1 hour, no API key needed to fetch
it), that returns the session's timeline when fetched: one slice per finished request still kept
(``future_ttl_s``) of the session's models and sampling clients (create, forward_backward,
optim_step, saves, loads, samples), from submission to its answer, on a track per kind, with the
unit's breakdown (queue, turn acquisition, compute, release, parks: rota_tinker._http.handles.unit_breakdown)
in its args. The file is Chrome's JSON trace format, which ui.perfetto.dev opens (not Perfetto's
protobuf format, whatever name it is saved under).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from rota_tinker._http.checkpoints import ID
from rota_tinker._http.formats import BadRequest
from rota_tinker._http.handles import unit_breakdown
from rota_tinker._http.server import Reply, Request
from rota_tinker._http.signed import check_caller, expiry, expiry_and_signature, make_url, signed

_DOWNLOAD = re.compile(rf"/api/v1/session_traces/({ID})")


class TraceRoutes:
    """The trace routes of :class:`rota_tinker._http.service._Api`."""

    state: Any
    config: Any
    url_key: bytes

    def _trace_export(self, req: Request, tenant: Any, session_id: str) -> Reply:
        with self.state.lock:
            ended = session_id in self.state.finished[tenant.name]
        if not ended:
            self._owned(self.state.sessions, session_id, "session", tenant)  # type: ignore[attr-defined]
        url = make_url(req, self.config, self.url_key, expiry(), f"/api/v1/session_traces/{session_id}", "trace",
                       tenant.name, session_id)
        return Reply.json({"status": "ready", "url": url})

    def download_trace(self, req: Request) -> Reply:
        """``GET /api/v1/session_traces/SID?expires=T&sig=S``: the trace, when S signs it for the session's owner."""
        m = _DOWNLOAD.fullmatch(req.path)
        if m is None:
            raise BadRequest("no such trace; use the URL export_session_trace gave", status=404)
        session_id = m.group(1)
        expires, sig = expiry_and_signature(req, "URL export_session_trace")
        owner = self._trace_owner(session_id)
        if owner is None or not signed(self.url_key, expires, sig, "trace", owner, session_id):
            raise BadRequest("this URL is not valid (expired, or not signed by this service); ask "
                             "export_session_trace for a new one", status=403)
        check_caller(req, self.config, owner, "this trace belongs to another tenant")
        return Reply(200, json.dumps(self._trace(owner, session_id)).encode())

    def _trace_owner(self, session_id: str) -> str | None:
        with self.state.lock:
            s = self.state.sessions.get(session_id)
            if s is not None:
                return s.tenant
            return next((t for t, ended in self.state.finished.items() if session_id in ended), None)

    def _trace(self, tenant: str, session_id: str) -> dict[str, Any]:
        """Chrome trace events of the session's kept, finished requests (wall-clock microseconds)."""
        to_wall = time.time() - time.monotonic()
        with self.state.lock:
            futures = [f for rid, f in self.state.futures.items()
                       if self.state.future_session.get(rid) == session_id and f.tenant == tenant]
        events: list[dict[str, Any]] = []
        tracks: dict[str, int] = {}
        for f in futures:
            start, end = f.timing.get("submitted"), f.finished_at
            if start is None or end is None:
                continue
            tid = tracks.setdefault(f.kind, len(tracks) + 1)
            events.append({"name": f.kind, "cat": "request", "ph": "X", "pid": 1, "tid": tid,
                           "ts": round((start + to_wall) * 1e6), "dur": max(0, round((end - start) * 1e6)),
                           "args": {"request_id": f.request_id, "failed": f.error is not None,
                                    **unit_breakdown(f.timing)}})
        meta = [{"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"session {session_id}"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": kind}}
                 for kind, tid in tracks.items()]
        return {"traceEvents": meta + sorted(events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}


PATTERNS = [("GET", re.compile(rf"/api/v1/sessions/({ID})/trace_export"), TraceRoutes._trace_export)]
WITH_REQUEST = (TraceRoutes._trace_export,)
