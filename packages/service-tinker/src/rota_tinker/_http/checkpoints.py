"""Training runs and checkpoints: ``save_state``/``load_state``, listing, deleting and downloading them.

The routes here are part of :class:`rota_tinker._http.service._Api` (a mixin: they use its state,
ownership checks and worker handles). Served (under ``/api/v1``):

* ``save_weights`` (``TrainingClient.save_state``): a training checkpoint
  ``tinker://MODEL/weights/NAME`` (weights and optimizer state, written by the trainer in a
  turn; files in :mod:`rota_tinker._worker.state_files`);
* ``load_weights``: into an existing model (``model_id``), or as a new model
  ``SESSION:train:SEQ`` (``ServiceClient.create_training_client_from_state[_with_optimizer]``
  send ``session_id`` and ``model_seq_id``, and address the model by that id from then on);
* ``GET training_runs`` (``limit``, ``offset``), ``GET training_runs/{id}``,
  ``GET training_runs/{id}/checkpoints``, ``GET checkpoints``, ``GET sessions``,
  ``GET sessions/{id}``: the caller's own runs, checkpoints and sessions only;
* ``DELETE training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}``;
* ``PUT training_runs/{id}/checkpoints/{kind}/{name}/ttl`` (``set_checkpoint_ttl_from_tinker_path``) and
  ``ttl_seconds`` of ``save_state``/``save_weights_for_sampler``: the checkpoint expires that long
  from now (at least :data:`MIN_TTL_S`; ``None``: never), is reported as ``expires_at`` and is
  deleted when it passes (an expired checkpoint answers 404 at once, its files go at the next sweep);
* ``POST``/``DELETE training_runs/{id}/checkpoints/{kind}/{name}/publish``: marks the owner's
  checkpoint public or private (reported as ``public``; no other tenant may read it either way:
  this service has no sharing between tenants);
* ``POST weights_info`` (``get_weights_info_by_tinker_path``): base model and LoRA shape of one
  of the caller's checkpoints; ``GET billing/usage/checkpoints/current``: the caller's own
  checkpoints' count and bytes;
* ``GET training_runs/{id}/checkpoints/{weights|sampler_weights}/{name}/archive``: the
  checkpoint's folder as an uncompressed tar (``adapter_model.safetensors`` +
  ``adapter_config.json`` for LoRA, ``config.json`` + ``*.safetensors`` + tokenizer files for
  full models; sampler weights are the same files without ``optimizer.pt``), at most
  :data:`MAX_ARCHIVE_BYTES`.

Every id and name is checked whole; folders are derived from them by the service (never taken
from a caller), and another tenant's run or checkpoint answers 403 like every other object.
"""

from __future__ import annotations

import datetime
import io
import os
import re
import secrets
import shutil
import tarfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

from rota_tinker._http.audit import AuditLog
from rota_tinker._http.budget import JSON_RESULT_BYTES
from rota_tinker._http.formats import CONFLICT, NOT_IMPLEMENTED, BadRequest, field_of
from rota_tinker._http.server import Reply

ID = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"  # model ids; ':' for the SDK's "SESSION:train:N"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # checkpoint names: they become file names
TRAINING_PATH = re.compile(rf"tinker://({ID})/weights/([A-Za-z0-9][A-Za-z0-9._-]{{0,63}})")
WEIGHTS_PATH = re.compile(rf"tinker://({ID})/(weights|sampler_weights)/([A-Za-z0-9][A-Za-z0-9._-]{{0,63}})")
MAX_ARCHIVE_BYTES = 2 * 2**30  # a bigger checkpoint is copied from the service's data dir instead
ARCHIVES_AT_ONCE = 2  # archives built in memory at the same time, service-wide (more: 429, try again)
MAX_RUNS = 1000  # run records kept per tenant (its oldest forgotten first; their checkpoints stay listed)
MAX_LIST = 1000
MIN_TTL_S = 5  # the shortest checkpoint TTL (the Tinker SDK documents 1 hour; shorter ones serve tests and scratch)
MAX_TTL_S = 10 * 366 * 86400


def user_metadata(value: Any) -> dict[str, str] | None:
    """A caller's ``user_metadata``: at most 32 string keys and values of 1-256 characters, else BadRequest."""
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > 32 or not all(
            isinstance(k, str) and isinstance(v, str) and 0 < len(k) <= 256 and len(v) <= 256
            for k, v in value.items()):
        raise BadRequest("user_metadata must map at most 32 strings of 1-256 characters to strings of at most 256")
    return dict(value)


def _iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat()


def ttl(body: dict[str, Any]) -> float | None:
    """When a checkpoint saved with ``body``'s ``ttl_seconds`` expires (wall clock), or None (never)."""
    seconds = field_of(body, "ttl_seconds", int, required=False, bounds=(MIN_TTL_S, MAX_TTL_S))
    return None if seconds is None else time.time() + seconds


def expired(item: Any, now: float | None = None) -> bool:
    return item.expires is not None and item.expires <= (time.time() if now is None else now)


@dataclass
class Run:
    """A training run (one model, live or unloaded) as ``RestClient`` lists it."""

    model_id: str
    tenant: str
    base: str
    lora_rank: int | None
    created: float = field(default_factory=time.time)
    last_request: float = field(default_factory=time.time)
    user_metadata: dict[str, str] | None = None
    lora: dict[str, Any] | None = None  # rank and targets, as create_model gave them
    session_id: str | None = None  # the session that created it
    project_id: str | None = None  # its session's project (rota_tinker._http.projects)


@dataclass
class Checkpoint:
    """A training checkpoint: ``tinker://RUN/weights/NAME`` in ``folder``."""

    path: str
    tenant: str
    run: str
    name: str
    base: Any  # the BaseModelSpec / HfModelSpec it was trained on
    lora: dict[str, Any] | None
    folder: str
    bytes: int
    created: float = field(default_factory=time.time)
    user_metadata: dict[str, str] | None = None
    expires: float | None = None  # wall clock; None: never
    public: bool = False


class Runs:
    """The service's run and checkpoint records (guarded by the service state's lock)."""

    def __init__(self) -> None:
        self.runs: OrderedDict[str, Run] = OrderedDict()
        self.checkpoints: dict[str, Checkpoint] = {}  # tinker path -> training checkpoint
        self.external: dict[str, Any] = {}  # tinker path -> rota_tinker._http.external.External
        self.archives = threading.BoundedSemaphore(ARCHIVES_AT_ONCE)
        self.audit = AuditLog()

    def record(self, model: Any, metadata: dict[str, str] | None, project: str | None = None) -> None:
        """Remember a new run; past MAX_RUNS of its tenant, that tenant's oldest is forgotten (no one else's)."""
        self.runs[model.model_id] = Run(model.model_id, model.tenant, model.base.name,
                                        model.lora["rank"] if model.lora else None, user_metadata=metadata,
                                        lora=model.lora, session_id=model.session_id, project_id=project)
        mine = [k for k, r in self.runs.items() if r.tenant == model.tenant]
        for k in mine[:max(0, len(mine) - MAX_RUNS)]:
            del self.runs[k]

    def touch(self, model_id: str) -> None:
        run = self.runs.get(model_id)
        if run is not None:
            run.last_request = time.time()

    def bytes_of(self, tenant: str) -> int:
        return sum(c.bytes for c in (*self.checkpoints.values(), *self.external.values()) if c.tenant == tenant)


def _page(query: str) -> tuple[int, int]:
    """``limit`` and ``offset`` from a query string (limit 1-1000, default 20; offset >= 0)."""
    try:
        args = parse_qs(query, max_num_fields=8)
        limit = int(args.get("limit", ["20"])[0])
        offset = int(args.get("offset", ["0"])[0])
    except ValueError:
        raise BadRequest("limit and offset must be integers") from None
    if not 1 <= limit <= MAX_LIST or not 0 <= offset <= 10**9:
        raise BadRequest(f"limit must be within [1, {MAX_LIST}] and offset within [0, 1e9]")
    return limit, offset


class CheckpointRoutes:
    """The checkpoint and listing routes of :class:`rota_tinker._http.service._Api`."""

    state: Any
    config: Any

    # ------------------------------------------------------------ save / load

    def _save_state(self, tenant: Any, body: dict[str, Any]) -> Reply:
        state = self.state
        m = self._model(tenant, field_of(body, "model_id", str))  # type: ignore[attr-defined]
        name = field_of(body, "path", str, required=False) or f"state-{secrets.token_hex(4)}"
        if not NAME.fullmatch(name):
            raise BadRequest(f"path {name[:80]!r} is not a valid checkpoint name: use 1-64 letters, digits, '.', '_', "
                             "'-', starting with a letter or digit")
        expires = ttl(body)
        overwrite = field_of(body, "overwrite", bool, required=False, default=False)
        metadata = user_metadata(body.get("user_metadata"))
        path = f"tinker://{m.model_id}/weights/{name}"
        with state.lock:
            old = state.runs.checkpoints.get(path)
            if old is not None and not overwrite:
                raise BadRequest(f"{path} exists; save under another name or pass overwrite=True", status=CONFLICT)
            state.check_quota(tenant.name, nbytes=max(0, m.bytes - (old.bytes if old else 0)))
        fut = state.future(tenant.name, "SaveWeights", m.session_id, result_bytes=JSON_RESULT_BYTES)

        def done(result: Any) -> None:
            ck = Checkpoint(path, tenant.name, m.model_id, name, m.base, m.lora, result["folder"], int(result["bytes"]),
                            user_metadata=metadata, expires=expires)
            with state.lock:
                state.runs.checkpoints[path] = ck
                state.runs.touch(m.model_id)
            state.runs.audit.note(tenant.name, "checkpoint_create", tinker_path=path, model_id=m.model_id)
            state.usage_counts.note(tenant.name, "checkpoint", 1, m.base.name, m.session_id)
            fut.succeed(json={"path": path, "type": "save_weights"})

        state.trainer_of(m).submit(
            fut, "save_state", {"model_id": m.model_id, "name": name, "base": m.base}, done)
        return self._future_reply(fut, m.model_id)  # type: ignore[attr-defined]

    def _checkpoint(self, tenant: Any, path: Any) -> Checkpoint:
        if not isinstance(path, str) or not TRAINING_PATH.fullmatch(path):
            shown = path[:140] if isinstance(path, str) else type(path).__name__
            raise BadRequest(f"path {shown!r} is not a training checkpoint; use the path save_state returned "
                             "(tinker://MODEL/weights/NAME)")
        ck = self._owned(self.state.runs.checkpoints, path, "checkpoint", tenant)  # type: ignore[attr-defined]
        if expired(ck):
            raise BadRequest(f"checkpoint {path!r} has expired (its TTL passed); save a new one", status=404)
        return ck

    def _load_weights(self, tenant: Any, body: dict[str, Any]) -> Reply:
        ck = self._checkpoint(tenant, field_of(body, "path", str))
        optimizer = field_of(body, "optimizer", bool, required=False, default=False)
        self.state.runs.audit.note(tenant.name, "checkpoint_read", tinker_path=ck.path, purpose="load")
        if body.get("weights_access_token") is not None:
            raise BadRequest("weights_access_token (another account's checkpoints) is not implemented by this "
                             "service; load your own checkpoints", status=NOT_IMPLEMENTED)
        answer = {"path": ck.path, "type": "load_weights"}
        if body.get("session_id") is not None:  # create-via-load: the SDK names the model SESSION:train:SEQ
            sid = self._session(tenant, body)  # type: ignore[attr-defined]
            seq = field_of(body, "model_seq_id", int, bounds=(0, 2**31))
            base = body.get("base_model")
            if base is not None and base != ck.base.name:
                raise BadRequest(f"base_model {str(base)[:140]!r} differs from {ck.base.name!r} of {ck.path}; leave "
                                 "base_model out")
            opt = field_of(body, "optimizer_config", dict, required=False, default={"type": "adamw"})
            if opt.get("type", "adamw") != "adamw":
                raise BadRequest("optimizer_config type is not implemented by this service; use adamw (the default)",
                                 status=NOT_IMPLEMENTED)
            model_id = f"{sid}:train:{seq}"
            answer["model_id"] = model_id
            fut = self._start_model(tenant, sid, model_id, ck.base, ck.lora,  # type: ignore[attr-defined]
                                    user_metadata(body.get("user_metadata")), answer,
                                    {"folder": ck.folder, "optimizer": optimizer})
            return self._future_reply(fut, model_id)  # type: ignore[attr-defined]
        m = self._model(tenant, field_of(body, "model_id", str))  # type: ignore[attr-defined]
        if m.base.name != ck.base.name or _adapters(m.lora) != _adapters(ck.lora):
            raise BadRequest(f"{ck.path} was saved from a {_kind(ck.base.name, ck.lora)} model; {m.model_id} is a "
                             f"{_kind(m.base.name, m.lora)} one: load it into a model of the same kind, or with "
                             "create_training_client_from_state")
        answer["model_id"] = m.model_id
        fut = self.state.future(tenant.name, "LoadWeights", m.session_id, result_bytes=JSON_RESULT_BYTES)
        self.state.trainer_of(m).submit(
            fut, "load_state", {"model_id": m.model_id, "folder": ck.folder, "optimizer": optimizer},
            lambda _r: fut.succeed(json=answer))
        return self._future_reply(fut, m.model_id)  # type: ignore[attr-defined]

    # ------------------------------------------------------------ listing

    def _run_json(self, run: Run) -> dict[str, Any]:
        cks = self._checkpoints_of(run.tenant, run.model_id)
        last = {kind: max((c for c in cks if c["checkpoint_type"] == kind), key=lambda c: c["time"], default=None)
                for kind in ("training", "sampler")}
        return {"training_run_id": run.model_id, "base_model": run.base, "model_owner": run.tenant,
                "is_lora": run.lora_rank is not None, "corrupted": False, "lora_rank": run.lora_rank,
                "last_request_time": _iso(run.last_request), "last_checkpoint": last["training"],
                "last_sampler_checkpoint": last["sampler"], "user_metadata": run.user_metadata}

    def _checkpoints_of(self, tenant: str, run: str | None) -> list[dict[str, Any]]:
        """The tenant's training and (named) sampler checkpoints, of one run or all, oldest first (lock taken)."""
        state = self.state
        with state.lock:
            training = [c for c in state.runs.checkpoints.values() if c.tenant == tenant and run in (None, c.run)]
            sampler = [w for w in state.weights.values() if w.tenant == tenant and not w.ephemeral
                       and run in (None, w.path.split("/")[2])]
            external = [e for e in state.runs.external.values() if e.tenant == tenant and run in (None, e.run)]
        now = time.time()
        out = [{"checkpoint_id": f"{kind}/{c.path.rsplit('/', 1)[1]}", "checkpoint_type": type_,
                "time": _iso(c.created), "tinker_path": c.path, "size_bytes": c.bytes, "public": c.public,
                "user_metadata": c.user_metadata, "expires_at": None if c.expires is None else _iso(c.expires)}
               for kind, type_, items in (("weights", "training", training), ("sampler_weights", "sampler", sampler),
                                          ("external_weights", "external", external))
               for c in items if not expired(c, now)]
        return sorted(out, key=lambda c: c["time"])

    def _run(self, tenant: Any, run_id: str) -> Run:
        return self._owned(self.state.runs.runs, run_id, "training run", tenant)  # type: ignore[attr-defined]

    def _list_runs(self, tenant: Any, query: str) -> Reply:
        limit, offset = _page(query)
        project = parse_qs(query, max_num_fields=8).get("project_id", [None])[0]
        with self.state.lock:
            runs = [r for r in self.state.runs.runs.values()
                    if r.tenant == tenant.name and project in (None, r.project_id)]
        runs.sort(key=lambda r: r.created, reverse=True)
        return Reply.json({"training_runs": [self._run_json(r) for r in runs[offset:offset + limit]],
                           "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)}})

    def _get_run(self, tenant: Any, run_id: str) -> Reply:
        return Reply.json(self._run_json(self._run(tenant, run_id)))

    def _list_run_checkpoints(self, tenant: Any, run_id: str) -> Reply:
        self._run(tenant, run_id)
        return Reply.json({"checkpoints": self._checkpoints_of(tenant.name, run_id)})

    def _list_user_checkpoints(self, tenant: Any, query: str) -> Reply:
        limit, offset = _page(query)
        cks = self._checkpoints_of(tenant.name, None)[::-1]
        return Reply.json({"checkpoints": cks[offset:offset + limit],
                           "cursor": {"offset": offset, "limit": limit, "total_count": len(cks)}})

    def _list_sessions(self, tenant: Any, query: str) -> Reply:
        limit, offset = _page(query)
        with self.state.lock:
            ids = [sid for sid, s in self.state.sessions.items() if s.tenant == tenant.name]
        return Reply.json({"sessions": ids[offset:offset + limit]})

    def _get_session(self, tenant: Any, session_id: str) -> Reply:
        session = self._owned(self.state.sessions, session_id, "session", tenant)  # type: ignore[attr-defined]
        with self.state.lock:
            runs = [m.model_id for m in self.state.models.values() if m.session_id == session_id]
            samplers = [s.session_id for s in self.state.sampling.values() if s.parent == session_id]
        return Reply.json({"training_run_ids": runs, "sampler_ids": samplers, "user_metadata": session.user_metadata,
                           "display_name": session.display_name})

    # ------------------------------------------------------------ TTL, publishing, info

    def _any_checkpoint(self, tenant: Any, run_id: str, kind: str, name: str) -> Any:
        """The caller's training checkpoint or sampler weights at ``tinker://RUN/KIND/NAME`` (404 once expired)."""
        path = f"tinker://{run_id}/{kind}/{name}"
        if kind == "weights":
            return self._checkpoint(tenant, path)
        if kind == "external_weights":
            return self._external(tenant, run_id, name)  # type: ignore[attr-defined]
        w = self._owned(self.state.weights, path, "sampler weights", tenant)  # type: ignore[attr-defined]
        if w.ephemeral or expired(w):
            raise BadRequest(f"sampler weights {path!r} do not exist (expired, or saved for one sampling client "
                             "only)", status=404)
        return w

    def _set_ttl(self, tenant: Any, run_id: str, kind: str, name: str, body: dict[str, Any]) -> Reply:
        """``set_checkpoint_ttl_from_tinker_path``: expire ``ttl_seconds`` from now (None: never)."""
        item = self._any_checkpoint(tenant, run_id, kind, name)
        expires = ttl(body)
        with self.state.lock:
            item.expires = expires
        self.state.runs.audit.note(tenant.name, "checkpoint_ttl_set", tinker_path=item.path,
                                   ttl_seconds=body.get("ttl_seconds"))
        return Reply.json({})

    def _publish(self, tenant: Any, run_id: str, kind: str, name: str, public: bool = True) -> Reply:
        item = self._any_checkpoint(tenant, run_id, kind, name)
        item.public = public
        self.state.runs.audit.note(tenant.name, "checkpoint_publish" if public else "checkpoint_unpublish",
                                   tinker_path=item.path)
        return Reply.json({})

    def _unpublish(self, tenant: Any, run_id: str, kind: str, name: str) -> Reply:
        return self._publish(tenant, run_id, kind, name, public=False)

    def by_path(self, tenant: Any, body: dict[str, Any], name: str) -> tuple[Any, re.Match[str], dict[str, Any] | None]:
        """The caller's training checkpoint or sampler weights at ``body[name]``, its path's parts (run, kind, name)
        and its LoRA shape (None: full parameters)."""
        path = field_of(body, name, str)
        m = WEIGHTS_PATH.fullmatch(path)
        if m is None:
            raise BadRequest(f"{name} {path[:140]!r} is not a checkpoint path; use tinker://RUN/weights/NAME or "
                             "tinker://RUN/sampler_weights/NAME")
        item = self._any_checkpoint(tenant, *m.groups())
        return item, m, item.lora if isinstance(item, Checkpoint) else self._run(tenant, m.group(1)).lora

    def _weights_info(self, tenant: Any, body: dict[str, Any]) -> Reply:
        """``get_weights_info_by_tinker_path``: what a checkpoint needs to be loaded (base model, LoRA shape)."""
        item, _, lora = self.by_path(tenant, body, "tinker_path")
        targets = lora["targets"] if lora else {}
        return Reply.json({"base_model": item.base.name, "is_lora": lora is not None,
                           "lora_rank": lora["rank"] if lora else None, "train_unembed": targets.get("unembed"),
                           "train_mlp": targets.get("mlp"), "train_attn": targets.get("attn")})

    def _storage_usage(self, tenant: Any, query: str) -> Reply:
        """``get_current_checkpoint_storage_usage``: the caller's own checkpoints, now (no billing here)."""
        cks = self._checkpoints_of(tenant.name, None)
        size = sum(c["size_bytes"] for c in cks)
        return Reply.json({"data": [{"user_name": tenant.name, "checkpoint_count": len(cks), "size_bytes": size,
                                     "size_gigabytes": size / 1e9}]})

    def expire(self) -> None:
        """Delete the checkpoints whose TTL passed (called by the service's sweep)."""
        state, now = self.state, time.time()
        with state.lock:
            gone = [c for c in state.runs.checkpoints.values() if expired(c, now)]
            for c in gone:
                state.runs.checkpoints.pop(c.path, None)
            weights = [(w.path, w.tenant) for w in state.weights.values() if expired(w, now)]
        self.expire_external(now)  # type: ignore[attr-defined]
        for c in gone:
            state.runs.audit.note(c.tenant, "checkpoint_expire", tinker_path=c.path)
            state.forget_checkpoint(c.tenant, c.path, c.folder, c.base)
            threading.Thread(target=shutil.rmtree, args=(c.folder, True), daemon=True).start()
        for path, owner in weights:
            state.runs.audit.note(owner, "checkpoint_expire", tinker_path=path)
            state.delete_weights(path)

    # ------------------------------------------------------------ delete / download

    def _delete_checkpoint(self, tenant: Any, run_id: str, kind: str, name: str) -> Reply:
        """``RestClient.delete_checkpoint[_from_tinker_path]``: the files go, their quota bytes are freed."""
        path = f"tinker://{run_id}/{kind}/{name}"
        if kind == "external_weights":
            self.delete_external(tenant, run_id, name)  # type: ignore[attr-defined]
        elif kind == "sampler_weights":
            self._owned(self.state.weights, path, "sampler weights", tenant)  # type: ignore[attr-defined]
            self.state.delete_weights(path)
        else:
            ck = self._checkpoint(tenant, path)
            with self.state.lock:
                self.state.runs.checkpoints.pop(path, None)
            self.state.forget_checkpoint(ck.tenant, ck.path, ck.folder, ck.base)
            threading.Thread(target=shutil.rmtree, args=(ck.folder, True), daemon=True).start()
        self.state.runs.audit.note(tenant.name, "checkpoint_delete", tinker_path=path)  # the owner's, done
        return Reply.json({})

    def _archive(self, tenant: Any, run_id: str, kind: str, name: str) -> Reply:
        """A checkpoint's folder as a tar, training checkpoint or sampler weights: peft / transformers
        ``from_pretrained`` load what it holds."""
        path = f"tinker://{run_id}/{kind}/{name}"
        if kind == "sampler_weights":
            w = self._owned(self.state.weights, path, "sampler weights", tenant)  # type: ignore[attr-defined]
            folder, size = w.file, w.bytes
        else:
            ck = self._checkpoint(tenant, path)
            folder, size = ck.folder, ck.bytes
        if size > MAX_ARCHIVE_BYTES:
            raise BadRequest(f"{path} has {size} bytes, over the {MAX_ARCHIVE_BYTES}-byte download limit; copy it "
                             "from the service's data directory instead", status=NOT_IMPLEMENTED)
        if not self.state.runs.archives.acquire(blocking=False):
            raise BadRequest(f"{ARCHIVES_AT_ONCE} archives are being built already; try again shortly", status=429)
        self.state.runs.audit.note(tenant.name, "checkpoint_read", tinker_path=path, purpose="archive")
        try:
            buf = io.BytesIO()
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for entry in sorted(os.listdir(folder)):
                    full = os.path.join(folder, entry)
                    if os.path.isfile(full) and not os.path.islink(full):
                        tar.add(full, arcname=f"{name}/{entry}", recursive=False)
            return Reply(200, buf.getvalue(), "application/x-tar")
        finally:
            self.state.runs.archives.release()


def _adapters(lora: dict[str, Any] | None) -> tuple[Any, ...] | None:
    """What a checkpoint's tensors depend on: LoRA rank and targets (not the init seed)."""
    return None if lora is None else (lora["rank"], sorted(k for k, v in lora["targets"].items() if v))


def _kind(base: str, lora: dict[str, Any] | None) -> str:
    return f"{base} LoRA rank {lora['rank']}" if lora else f"{base} full-parameter"


# routes with ids in the path (each checked whole); "query" handlers also get the query string
KINDS = "weights|sampler_weights|external_weights"
PATTERNS = [
    ("GET", re.compile(rf"/api/v1/training_runs/({ID})"), CheckpointRoutes._get_run),
    ("GET", re.compile(rf"/api/v1/training_runs/({ID})/checkpoints"), CheckpointRoutes._list_run_checkpoints),
    ("DELETE", re.compile(rf"/api/v1/training_runs/({ID})/checkpoints/({KINDS})/({ID})"),
     CheckpointRoutes._delete_checkpoint),
    ("GET", re.compile(rf"/api/v1/training_runs/({ID})/checkpoints/(weights|sampler_weights)/({ID})/archive"),
     CheckpointRoutes._archive),
    ("GET", re.compile(rf"/api/v1/sessions/({ID})"), CheckpointRoutes._get_session),
    ("PUT", re.compile(rf"/api/v1/training_runs/({ID})/checkpoints/({KINDS})/({ID})/ttl"),
     CheckpointRoutes._set_ttl),
    ("POST", re.compile(rf"/api/v1/training_runs/({ID})/checkpoints/({KINDS})/({ID})/publish"),
     CheckpointRoutes._publish),
    ("DELETE", re.compile(rf"/api/v1/training_runs/({ID})/checkpoints/({KINDS})/({ID})/publish"),
     CheckpointRoutes._unpublish),
]
ROUTES = {
    "/api/v1/save_weights": ("POST", CheckpointRoutes._save_state),
    "/api/v1/load_weights": ("POST", CheckpointRoutes._load_weights),
    "/api/v1/training_runs": ("GET", CheckpointRoutes._list_runs),
    "/api/v1/checkpoints": ("GET", CheckpointRoutes._list_user_checkpoints),
    "/api/v1/sessions": ("GET", CheckpointRoutes._list_sessions),
    "/api/v1/weights_info": ("POST", CheckpointRoutes._weights_info),
    "/api/v1/billing/usage/checkpoints/current": ("GET", CheckpointRoutes._storage_usage),
}
WITH_QUERY = (CheckpointRoutes._list_runs, CheckpointRoutes._list_user_checkpoints, CheckpointRoutes._list_sessions,
              CheckpointRoutes._storage_usage)
WITH_BODY = (CheckpointRoutes._set_ttl,)  # path ids and a JSON body
