"""Projects and session search: labels a tenant gives its own sessions and runs, and what finds them again.

Routes of :class:`rota_tinker._http.service._Api` (a mixin, like :mod:`rota_tinker._http.checkpoints`). A
project is a name inside one tenant (this service has no organisations; nothing is shared):

* ``create_session``'s ``project_id`` and ``PUT sessions/{id}/project``
  (``RestClient.assign_session_project``) label a session; runs created in it carry the label;
* ``POST sessions/search`` (``RestClient.search_sessions``): the caller's live sessions (ended ones
  are not kept), newest first, filtered by session id or display-name words, user metadata,
  projects and status (``active``), paged by its cursor;
* ``POST copy_weights`` (``RestClient.copy_weights``, ``ServiceClient.copy_weights``): a training
  checkpoint or sampler weights of the caller, hard-linked (no bytes copied) into a new run of the
  destination project that cannot be trained; the copy has its own TTL and outlives the source.
"""

from __future__ import annotations

import datetime
import os
import re
import secrets
from typing import Any

from rota_tinker._http.checkpoints import ID, Checkpoint, Run, ttl
from rota_tinker._http.formats import NOT_IMPLEMENTED, BadRequest, field_of
from rota_tinker._http.server import Reply
from rota_tinker._worker.state_files import private_dir

PROJECT = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
MAX_SEARCH = 200


def project_id(value: Any, where: str = "project_id") -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not PROJECT.fullmatch(value):
        raise BadRequest(f"{where} must be 1-128 letters, digits, '.', '_', ':', '-', starting with a letter or digit")
    return value


_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.timezone.utc)


def _us(t: float) -> int:
    """A wall time in whole microseconds: what created_at shows, so a cursor compares exactly."""
    return round(t * 1e6)


def _iso(us: int) -> str:
    return (_EPOCH + datetime.timedelta(microseconds=us)).isoformat()


def _when(value: Any) -> int:
    try:
        when = datetime.datetime.fromisoformat(str(value))
    except ValueError:
        raise BadRequest("cursor.last_created_at must be an ISO 8601 time with its zone") from None
    if when.tzinfo is None:
        raise BadRequest("cursor.last_created_at must carry its zone (the created_at search_sessions gave)")
    delta = when - _EPOCH
    return (delta.days * 86400 + delta.seconds) * 10**6 + delta.microseconds


class ProjectRoutes:
    """The project, session-search and copy routes of :class:`rota_tinker._http.service._Api`."""

    state: Any
    config: Any

    def _assign_project(self, tenant: Any, session_id: str, body: dict[str, Any]) -> Reply:
        session = self._owned(self.state.sessions, session_id, "session", tenant)  # type: ignore[attr-defined]
        session.project_id = project_id(field_of(body, "project_id", str))
        self.state.runs.audit.note(tenant.name, "project_session_assign", session_id=session_id,
                                   project_id=session.project_id)
        return Reply.json({})

    def _search_sessions(self, tenant: Any, body: dict[str, Any]) -> Reply:
        limit = field_of(body, "limit", int, required=False, default=50, bounds=(1, MAX_SEARCH))
        sid = field_of(body, "session_id", str, required=False)
        words = (field_of(body, "display_name", str, required=False) or "").lower().split()
        meta = field_of(body, "user_metadata", dict, required=False, default={})
        projects = field_of(body, "project_ids", list, required=False)
        statuses = field_of(body, "statuses", list, required=False)
        owner = field_of(body, "owner", dict, required=False, default={"type": "own"})
        if owner.get("type") == "user":
            raise BadRequest("owner type 'user' (other users' sessions) is not implemented by this service: a tenant "
                             "sees its own sessions only", status=NOT_IMPLEMENTED)
        if statuses is not None and not all(isinstance(s, dict) for s in statuses):
            raise BadRequest("statuses must be a list of status queries ({'type': 'active'}, ...)")
        want_active = statuses is None or any(s.get("type") == "active" for s in statuses)
        cursor = field_of(body, "cursor", dict, required=False)
        after = None if cursor is None else (_when(cursor.get("last_created_at")), str(cursor.get("last_session_id")))
        with self.state.lock:
            mine = [s for s in self.state.sessions.values() if s.tenant == tenant.name]
            counts: dict[str, int] = {}
            for c in self.state.runs.checkpoints.values():
                run = self.state.runs.runs.get(c.run)
                if c.tenant == tenant.name and run is not None and run.session_id:
                    counts[run.session_id] = counts.get(run.session_id, 0) + 1

        def matches(s: Any) -> bool:
            name = (s.display_name or "").lower()
            by_name = bool(words) and all(w in name for w in words)
            if (sid or words) and not (s.session_id == sid or by_name):
                return False
            if any((s.user_metadata or {}).get(k) != v for k, v in meta.items()):
                return False
            return (projects is None or s.project_id in projects) and want_active

        found = sorted((s for s in mine if matches(s)), key=lambda s: (-_us(s.created), s.session_id))
        if after is not None:
            found = [s for s in found if (-_us(s.created), s.session_id) > (-after[0], after[1])]
        page = found[:limit]
        out = [{"session_id": s.session_id, "created_at": _iso(_us(s.created)), "owner": tenant.name,
                "project_id": s.project_id or "", "status": {"type": "active"},
                "checkpoints_count": counts.get(s.session_id, 0), "display_name": s.display_name,
                "user_metadata": s.user_metadata} for s in page]
        nxt = ({"last_created_at": out[-1]["created_at"], "last_session_id": out[-1]["session_id"]}
               if len(found) > limit else None)
        return Reply.json({"sessions": out, "next_cursor": nxt})

    def _copy_weights(self, tenant: Any, body: dict[str, Any]) -> Reply:
        """Hard-link one of the caller's checkpoints into a new, untrainable run of ``destination_project_id``."""
        if body.get("weights_access_token") is not None:
            raise BadRequest("weights_access_token (another account's checkpoints) is not implemented by this "
                             "service; copy your own checkpoints", status=NOT_IMPLEMENTED)
        project = project_id(field_of(body, "destination_project_id", str, required=False), "destination_project_id")
        expires = ttl(body)
        item, m, lora = self.by_path(tenant, body, "source_path")  # type: ignore[attr-defined]
        kind, name = m.group(2), m.group(3)
        src_folder = item.folder if isinstance(item, Checkpoint) else item.file
        state = self.state
        with state.lock:
            state.check_quota(tenant.name, nbytes=item.bytes)
        run_id = f"{tenant.name}-copy-{secrets.token_hex(4)}"
        folder = private_dir(os.path.join(private_dir(os.path.join(
            private_dir(os.path.join(self.config.data_dir, tenant.name, run_id)), kind)), name))
        for entry in sorted(os.listdir(src_folder)):
            full = os.path.join(src_folder, entry)
            if os.path.isfile(full) and not os.path.islink(full):
                os.link(full, os.path.join(folder, entry))
        path = f"tinker://{run_id}/{kind}/{name}"
        run = Run(run_id, tenant.name, item.base.name, lora["rank"] if lora else None, lora=lora,
                  project_id=project)
        with state.lock:
            state.runs.runs[run_id] = run
            if kind == "weights":
                state.runs.checkpoints[path] = Checkpoint(path, tenant.name, run_id, name, item.base, lora, folder,
                                                          item.bytes, expires=expires)
            else:
                state.weights[path] = self.copied_weights(item, path, folder, expires)  # type: ignore[attr-defined]
        state.runs.audit.note(tenant.name, "checkpoint_read", tinker_path=item.path, purpose="copy")
        state.runs.audit.note(tenant.name, "checkpoint_create", tinker_path=path, model_id=run_id,
                              copied_from=item.path, project_id=project)
        return Reply.json({"tinker_path": path})


PATTERNS = [("PUT", re.compile(rf"/api/v1/sessions/({ID})/project"), ProjectRoutes._assign_project)]
ROUTES = {"/api/v1/sessions/search": ("POST", ProjectRoutes._search_sessions),
          "/api/v1/copy_weights": ("POST", ProjectRoutes._copy_weights)}
WITH_BODY = (ProjectRoutes._assign_project,)
