"""The HTTP service: the subset of the Tinker API that the tinker SDK (0.38) uses to train and sample.

Who calls it: the official ``tinker`` SDK (``TINKER_BASE_URL=http://HOST:PORT``,
``TINKER_API_KEY=tml-...``), started by ``rota tinker serve`` or, in tests, by
:class:`TinkerService` directly. Served by uvicorn (:mod:`rota_tinker._http.server`): every
request is small (work runs in the workers), handlers run on a few threads, and
``retrieve_future`` long-polls without holding one.

Served routes (all under ``/api/v1``): ``healthz``, ``client/config``,
``client/dynamic_config``, ``create_session``, ``session_heartbeat``,
``sessions/{id}/finish``, ``telemetry``, ``get_server_capabilities``, ``create_model``,
``unload_model``, ``get_info``, ``forward_backward`` (protobuf), ``optim_step``,
``save_weights_for_sampler``, ``DELETE training_runs/{model}/checkpoints/sampler_weights/{name}``,
``create_sampling_session``, ``samplers/{id}``, ``asample``, ``retrieve_future``.

Rules enforced here:

* ``X-API-Key`` maps to a tenant (401 when missing or unknown, decided from the headers
  before any body is read; keys compared with ``hmac.compare_digest``); sessions,
  models, sampling sessions, sampler weights and futures belong to the tenant that
  created them (403 to any other tenant).
* Bodies are limited before they are read (413), checked field by field (400 naming the
  field: finite numbers, integers in range, token ids in the vocabulary, JSON nesting),
  content types too (415); unknown ids are 404, unsupported features 400.
* Per-key quotas (``ServiceConfig.max_models``, ``max_sessions``, ``max_bytes``): past one,
  429 saying which and how to free some. A session ends when the SDK finishes it or its
  heartbeats stop for ``session_ttl_s``; its models are then unloaded and its sampling
  sessions end. ``unload_model`` frees one model, deleting a checkpoint frees its file.
* Work units go to the tenant's trainer or sampler worker (:mod:`rota_tinker._worker.main`)
  and come back as futures; a failed unit (or a dead worker) fails its future with an
  error the SDK raises as ``RequestFailedError``.
* LoRA models (and samplers of LoRA weights or of a bare base) attach to the one
  resident base of their (device, base) held by a base-holder process
  (:mod:`rota_tinker._worker.holder`), started on first use and stopped after every tenant
  worker (the producer of shared memory outlives its consumers).
* Turns: without ``ServiceConfig.endpoint`` the service serves its own orchestrator on a
  Unix socket in a directory only its uid can enter, so no other user can take the
  tenants' group; with one, workers present ``ROTA_TOKEN``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rota_tinker._config import ServiceConfig, Tenant
from rota_tinker._http import audit as _audit
from rota_tinker._http import checkpoints as _checkpoints
from rota_tinker._http import external as _external
from rota_tinker._http import formats as _formats
from rota_tinker._http import projects as _projects
from rota_tinker._http import trace as _trace
from rota_tinker._http import usage as _usage
from rota_tinker._http.formats import NOT_IMPLEMENTED, BadRequest, QuotaExceeded, field_of
from rota_tinker._http.handles import Future, close_all, unit_breakdown
from rota_tinker._http.sampling import SamplingRoutes
from rota_tinker._http.server import HttpServer, Reply, Request
from rota_tinker._http.state import _ID, CLIENT_CONFIG, PROTO, SDK_BYTES_PER_TOKEN, _json, _Model, _Session, _State
from rota_tinker._http.training import TrainingRoutes
from rota_tinker._worker.state_files import private_dir

log = logging.getLogger(__name__)


class _Api(TrainingRoutes, SamplingRoutes, _checkpoints.CheckpointRoutes, _external.ExternalRoutes,
           _projects.ProjectRoutes, _audit.AuditRoutes, _usage.UsageRoutes, _trace.TraceRoutes):
    """The routes. Each handler gets the request, its tenant and its parsed body (or a path argument)."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self.config = state.config
        self.pool = ThreadPoolExecutor(max_workers=state.config.http_threads, thread_name_prefix="rota-tinker-http")
        self.url_key = secrets.token_bytes(32)  # signs external weights' download URLs (they die with the process)

    # ------------------------------------------------------------ plumbing

    async def __call__(self, req: Request) -> Reply:
        if req.path == "/api/v1/healthz" and req.method == "GET":
            return _json({"status": "ok"})
        loop = asyncio.get_running_loop()
        if req.path.startswith("/api/v1/external_weights/"):  # a signed URL: the signature is the credential
            if req.method != "GET":
                raise BadRequest(f"{req.path[:120]} takes GET, not {req.method}", status=405)
            return await loop.run_in_executor(self.pool, self.download_external, req)
        if req.path.startswith("/api/v1/session_traces/"):  # likewise
            if req.method != "GET":
                raise BadRequest(f"{req.path[:120]} takes GET, not {req.method}", status=405)
            return await loop.run_in_executor(self.pool, self.download_trace, req)
        want, handler, args = self._route(req.path, req.method)
        if req.method != want:
            raise BadRequest(f"{req.path} takes {want}, not {req.method}", status=405)
        tenant = self._tenant(req)  # from the headers alone: a refused caller's body is never read
        limit = self.config.max_body_bytes if handler is _Api._forward_backward else self.config.max_json_bytes
        body = await req.body(limit, self.config.body_timeout_s)
        if handler is _Api._lookup_future:
            fut = await loop.run_in_executor(self.pool, self._guarded, handler, req, tenant, body)
            if isinstance(fut, Reply):
                return fut
            return await self._retrieve_future(req, fut)
        return await loop.run_in_executor(self.pool, self._guarded, handler, req, tenant, body, *args)

    def _guarded(self, fn: Callable[..., Any], req: Request, tenant: Tenant, body: bytes, *args: str) -> Any:
        """Run a handler on a pool thread; a bug answers 500 without its details (they go to the log)."""
        try:
            if self.state.sweep():
                self.expire()
            if fn is _Api._forward_backward:
                return fn(self, req, tenant, body)
            if fn in _external.WITH_REQUEST or fn in _trace.WITH_REQUEST:
                return fn(self, req, tenant, *args)
            if fn in _checkpoints.WITH_QUERY or fn in _audit.WITH_QUERY or fn in _usage.WITH_QUERY:
                return fn(self, tenant, req.query)
            if fn in _checkpoints.WITH_BODY or fn in _projects.WITH_BODY:
                return fn(self, tenant, *args, self._json_body(req, body))
            if args or req.method == "GET":  # the ids are in the path; a body, if any, says nothing more
                return fn(self, tenant, *args)
            return fn(self, tenant, self._json_body(req, body))
        except BadRequest as e:
            kind = FUTURE_ROUTES.get(req.path)
            if isinstance(e, QuotaExceeded) and kind is None and req.path not in QUOTA_AS_429:
                # the SDK sends these through its retry loop, which retries a 429 for 5 minutes whatever
                # x-should-retry says: a 400 it raises at once, naming the quota
                raise BadRequest(f"{e.status} {REFUSED_AS_FUTURES[e.status]}: {e}") from e
            if e.status not in REFUSED_AS_FUTURES or kind is None:
                raise
            # the SDK retries a 429 or 5xx of these submissions for 5 minutes (it does not read x-should-retry
            # there): a future that fails at once makes it raise now, with the message naming the cause
            log.info("%s %s -> %d as a failed %s future: %s", req.method, req.path, e.status, kind, e)
            fut = self.state.future(tenant.name, kind)
            fut.fail(f"{e.status} {REFUSED_AS_FUTURES[e.status]}: {e}", "user")
            return self._future_reply(fut)
        except Exception:
            ref = secrets.token_hex(4)
            log.exception("%s %s failed (error %s)", req.method, req.path, ref)
            return _json({"detail": f"internal error {ref}; the service's log has the details", "status": 500}, 500)

    def _route(self, path: str, method: str) -> tuple[str, Callable[..., Any], tuple[str, ...]]:
        for pattern, what in UNSUPPORTED:
            if pattern.fullmatch(path):
                raise BadRequest(f"{what} is not implemented by this service (rota-service-tinker); its README "
                                 "lists what is served", status=NOT_IMPLEMENTED)
        route = ROUTES.get(path)
        if route is not None:
            return route[0], route[1], ()
        found = [(want, fn, m.groups()) for want, pattern, fn in PATTERNS if (m := pattern.fullmatch(path))]
        if found:  # one path may take several methods (publish: POST and DELETE)
            return next((f for f in found if f[0] == method), found[0])
        raise BadRequest("no such route; this service serves the tinker SDK's /api/v1 training and sampling routes "
                         "(see rota_tinker's README)", status=404)

    def _tenant(self, req: Request) -> Tenant:
        key = req.headers.get("x-api-key")
        if not key:
            raise BadRequest("X-API-Key header is missing; set TINKER_API_KEY to your tml-... key", status=401)
        tenant = self.config.tenant_for_key(key)
        if tenant is None:
            raise BadRequest("this API key is not known to this service; use the key you were given", status=401)
        return tenant

    def _json_body(self, req: Request, body: bytes) -> dict[str, Any]:
        ctype = req.header("content-type").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise BadRequest(f"Content-Type {ctype[:60] or '(none)'!r} is not accepted here; send application/json",
                             status=415)
        body = _formats.decompress(body, req.header("content-encoding"), self.config.max_json_bytes)
        return _formats.parse_json(body)

    # ------------------------------------------------------------ ownership

    def _owned(self, table: dict[str, Any], key: str, what: str, tenant: Tenant) -> Any:
        with self.state.lock:
            item = table.get(key)
        if item is None:
            kept = (f" (results are kept {self.config.future_ttl_s:g} s after they finish)"
                    if what == "request" else "")
            raise BadRequest(f"{what} {key[:140]!r} does not exist{kept}; use an id this service returned",
                             status=404)
        if item.tenant != tenant.name:
            raise BadRequest(f"{what} {key[:140]!r} belongs to another tenant; use your own", status=403)
        return item

    def _session(self, tenant: Tenant, body: dict[str, Any]) -> str:
        sid = field_of(body, "session_id", str)
        with self.state.lock:
            ended = sid in self.state.finished[tenant.name]
        if ended:
            raise BadRequest(f"session {sid!r} has ended; create a new session", status=410)
        self._owned(self.state.sessions, sid, "session", tenant)
        return sid

    def _model(self, tenant: Tenant, model_id: str) -> _Model:
        m = self._owned(self.state.models, model_id, "model", tenant)
        with self.state.lock:
            self.state.runs.touch(model_id)
        return m

    @staticmethod
    def _future_reply(fut: Future, model_id: str | None = None, **extra: Any) -> Reply:
        return _json({"request_id": fut.request_id, "model_id": model_id, **extra})

    # ------------------------------------------------------------ session routes

    def _client_config(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        # The SDK splits forward_backward batches by its estimate of their bytes, at least
        # SDK_BYTES_PER_TOKEN per token of a datum: this bound keeps each request under max_request_tokens.
        chunk_bytes = self.config.max_request_tokens * SDK_BYTES_PER_TOKEN
        return _json({**CLIENT_CONFIG, "fwdbwd_max_chunk_bytes_count": chunk_bytes})

    def _dynamic_config(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        return _json({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    def _create_session(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        field_of(body, "sdk_version", str, required=False)
        tags = field_of(body, "tags", list, required=False, default=[])
        if not all(isinstance(t, str) for t in tags):
            raise BadRequest("field 'tags' must be a list of strings")
        metadata = _checkpoints.user_metadata(body.get("user_metadata"))
        project = _projects.project_id(body.get("project_id"))
        name = field_of(body, "display_name", str, required=False)
        if name is not None and not 0 < len(name) <= 256:
            raise BadRequest("display_name must have 1-256 characters")
        state = self.state
        sid = state.new_id(f"{tenant.name}-session")
        with state.lock:
            state.check_quota(tenant.name, sessions=1)
            state.sessions[sid] = _Session(sid, tenant.name, time.monotonic(), metadata, name, project)
        log.info("tenant %s: session %s", tenant.name, sid)
        return _json({"type": "create_session", "session_id": sid})

    def _heartbeat(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        sid = self._session(tenant, body)  # an ended session answers 410: the SDK stops its heartbeat loop
        if self.state.stopping:
            with self.state.lock:
                self.state.farewelled.add(sid)
            raise BadRequest("the service is stopping: this session has ended", status=410)
        with self.state.lock:
            session = self.state.sessions.get(sid)
            if session is not None:
                session.last_seen = time.monotonic()
        return _json({"type": "session_heartbeat"})

    def _finish_session(self, tenant: Tenant, session_id: str) -> Reply:
        """``ServiceClient.close()``: the session ends, its models are unloaded; heartbeats then get 410."""
        with self.state.lock:
            ended = session_id in self.state.finished[tenant.name]
        if not ended:
            self._owned(self.state.sessions, session_id, "session", tenant)
            self.state.end_session(session_id, "finished by the client")
        return _json({})

    def _telemetry(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        return _json({"status": "accepted"})

    def _capabilities(self, tenant: Tenant) -> Reply:
        models = [{"model_name": m.name, "max_context_length": m.max_len, "trainable": True, "sampleable": True}
                  for m in self.config.base_models.values()]
        return _json({"supported_models": models})

    # ------------------------------------------------------------ futures

    def _lookup_future(self, tenant: Tenant, body: dict[str, Any]) -> Future:
        rid = field_of(body, "request_id", str)
        field_of(body, "allow_metadata_only", bool, required=False)
        return self._owned(self.state.futures, rid, "request", tenant)

    async def _retrieve_future(self, req: Request, fut: Future) -> Reply:
        """Hold the request until ``fut`` is done or ``long_poll_s`` passes (no thread waits meanwhile)."""
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the service is stopping
                loop.call_soon_threadsafe(ready.set)

        fut.add_done_callback(wake)
        try:
            await asyncio.wait_for(ready.wait(), self.config.long_poll_s)
        except asyncio.TimeoutError:
            return _json({"type": "try_again", "request_id": fut.request_id, "queue_state": "active",
                          "queue_state_reason": "running or waiting for its turn on the GPU"})
        finally:
            fut.remove_done_callback(wake)
        proto, answer = fut.proto, fut.json  # read once: the budget may let them go meanwhile
        if fut.error is not None:
            reply = _json({"error": fut.error, "category": fut.category, "request_id": fut.request_id})
        elif fut.dropped:
            raise BadRequest(f"the result of {fut.request_id} was answered already and let go "
                             f"{self.config.result_grace_s:g} s after (--result-grace); results are kept for one "
                             "answer", status=404)
        elif proto is not None:
            if PROTO not in req.header("accept"):
                raise BadRequest(f"the result of {fut.request_id} ({fut.kind}) is protobuf; send Accept: {PROTO}",
                                 status=406)
            reply = Reply(200, proto, PROTO)
        else:
            reply = _json(answer)
        fut.timing.setdefault("answered", time.monotonic())
        self.state.budget.delivered(fut)
        return reply


ROUTES: dict[str, tuple[str, Callable[..., Any]]] = {
    "/api/v1/client/config": ("POST", _Api._client_config),
    "/api/v1/client/dynamic_config": ("POST", _Api._dynamic_config),
    "/api/v1/create_session": ("POST", _Api._create_session),
    "/api/v1/session_heartbeat": ("POST", _Api._heartbeat),
    "/api/v1/telemetry": ("POST", _Api._telemetry),
    "/api/v1/get_server_capabilities": ("GET", _Api._capabilities),
    "/api/v1/create_model": ("POST", _Api._create_model),
    "/api/v1/unload_model": ("POST", _Api._unload_model),
    "/api/v1/get_info": ("POST", _Api._get_info),
    "/api/v1/forward_backward": ("POST", _Api._forward_backward),
    "/api/v1/optim_step": ("POST", _Api._optim_step),
    "/api/v1/save_weights_for_sampler": ("POST", _Api._save_for_sampler),
    "/api/v1/create_sampling_session": ("POST", _Api._create_sampling_session),
    "/api/v1/asample": ("POST", _Api._asample),
    "/api/v1/retrieve_future": ("POST", _Api._lookup_future),
}
# the routes whose answer is a future the SDK then polls -> the future's kind
FUTURE_ROUTES = {"/api/v1/create_model": "CreateModel", "/api/v1/unload_model": "UnloadModel",
                 "/api/v1/forward_backward": "ForwardBackward", "/api/v1/optim_step": "OptimStep",
                 "/api/v1/save_weights_for_sampler": "SaveWeightsForSampler", "/api/v1/asample": "Sample",
                 "/api/v1/save_weights": "SaveWeights", "/api/v1/load_weights": "LoadWeights",
                 "/api/v1/save_weights_external": "SaveWeightsExternal"}
REFUSED_AS_FUTURES = {429: "Too Many Requests"}  # a quota
# routes the SDK calls without its retry loop: its client reads x-should-retry: false on a quota's 429 and raises
# RateLimitError at once; a quota on any other route that is not a future is a 400 (_Api._guarded)
QUOTA_AS_429 = {"/api/v1/create_session", "/api/v1/create_sampling_session"}
# routes with ids in the path (each id checked whole by its pattern)
PATTERNS: list[tuple[str, re.Pattern[str], Callable[..., Any]]] = [
    ("GET", re.compile(rf"/api/v1/samplers/({_ID})"), _Api._get_sampler),
    ("POST", re.compile(rf"/api/v1/sessions/({_ID})/finish"), _Api._finish_session),
    *_checkpoints.PATTERNS,
    *_external.PATTERNS,
    *_projects.PATTERNS,
    *_trace.PATTERNS,
]
ROUTES.update(_checkpoints.ROUTES)
ROUTES.update(_external.ROUTES)
ROUTES.update(_projects.ROUTES)
ROUTES.update(_audit.ROUTES)
ROUTES.update(_usage.ROUTES)
# routes of the SDK this service does not implement -> the feature a 400 names (the SDK does not retry a 400)
UNSUPPORTED: list[tuple[re.Pattern[str], str]] = [(re.compile(rf"/api/v1/{p}"), what) for p, what in (
    ("join_sampling_session", "join_sampling_session (sampler handles shared across processes)"),
    ("retrieve_futures", "retrieve_futures (batched polling)"), ("cancel_future", "cancel_future"),
    ("create_custom_loss", "create_custom_loss (server-side custom losses; forward_backward_custom works)"),
    ("auth/token", "auth/token (JWT credentials; use the tml-... API key)"))]


class TinkerService:
    """The service: HTTP front end plus one trainer and one sampler worker per tenant.

    ``with TinkerService(config) as svc: ...`` serves on ``svc.url`` in a
    background thread; workers start on a tenant's first work unit and stop with the service.
    """

    endpoint: str  # the orchestrator the workers use: config.endpoint, or the service's own (unix:PATH)

    def __init__(self, config: ServiceConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self._orchestrator = contextlib.ExitStack()
        try:
            os.makedirs(config.data_dir, mode=0o700, exist_ok=True)
            private_dir(config.data_dir)
            for t in config.tenants:  # the workers write each tenant's files under here (0700 all the way)
                private_dir(os.path.join(config.data_dir, t.name))
            self.endpoint = config.endpoint or self._own_orchestrator(config)
            self.config = config
            self.state = _State(config, self.endpoint)
            self.api = _Api(self.state)
            self._http = HttpServer(self.api, host, port, max_connections=config.max_connections,
                                    header_timeout_s=config.header_timeout_s, body_timeout_s=config.body_timeout_s,
                                    max_client_connections=config.max_client_connections,
                                    max_unauthenticated=min(config.max_unauthenticated,
                                                            max(1, config.max_connections // 2)),
                                    max_key_connections=min(config.max_key_connections,
                                                            max(1, config.max_connections // 4)),
                                    is_key=lambda key: config.tenant_for_key(key) is not None,
                                    tls_cert=config.tls_cert, tls_key=config.tls_key)
        except BaseException:
            self._orchestrator.close()
            raise

    def _own_orchestrator(self, config: ServiceConfig) -> str:
        """Serve a private orchestrator (in this process) on a Unix socket in a new 0700 directory; its endpoint.

        Only this uid can enter the directory, so only this service's workers reach the socket
        (no token needed: the contract's ``ServerAuth(local=True)``), and two services on one
        host never share an orchestrator, a group or a job id.
        """
        from rota.auth import ServerAuth
        from rota.orchestrator import OrchestratorConfig, running_orchestrator
        from rota.policies import Fifo
        from rota_tinker._worker.shared_turn import MAX_TURN_S

        xdg = os.environ.get("XDG_RUNTIME_DIR")
        folder = tempfile.mkdtemp(prefix="rota-tinker-", dir=xdg if xdg and os.path.isdir(xdg) else None)
        self._orchestrator.callback(shutil.rmtree, folder, True)
        # a busy shared LoRA turn would hold the device forever: past MAX_TURN_S, with others waiting, it is asked
        # to yield
        policy = Fifo(max_turn_s=MAX_TURN_S if config.lora_concurrency > 1 or config.lora_batch else 0.0)
        endpoint, _engine = self._orchestrator.enter_context(running_orchestrator(
            OrchestratorConfig(capacity_bytes=config.capacity_bytes, policy=policy),
            listen=f"unix:{folder}/orchestrator.sock", auth=ServerAuth(local=True)))
        log.info("own orchestrator at %s%s", endpoint,
                 f", capacity {config.capacity_bytes / 2**30:.1f} GiB" if config.capacity_bytes else "")
        return endpoint

    @property
    def url(self) -> str:
        host, port = self._http.address
        scheme = "https" if self._http.tls else "http"
        return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"

    def start(self) -> str:
        """Serve in a background thread; returns the base URL."""
        self._http.start()
        log.info("tinker service on %s for tenants %s (device %s, group %s)", self.url,
                 [t.name for t in self.config.tenants], self.config.device, self.config.group)
        return self.url

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`stop` (or SIGINT/SIGTERM)."""
        self._http.serve_forever()

    def worker_pid(self, tenant: str, role: str) -> int | None:
        """The pid of a tenant's trainer or sampler worker (None before its first work unit)."""
        return self.state.workers[(tenant, role)].pid

    def usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds against its quotas: models, sessions, bytes."""
        with self.state.lock:
            return self.state.usage(tenant)

    def base_holder_info(self, base_name: str, *, checksum: bool = False, timeout_s: float = 120.0) -> dict[str, Any]:
        """What the holder of ``base_name`` reports (pid, bytes, its shared segment on CPU, optionally a checksum).

        For tests and benchmarks: shows that tenants share one copy and never change it.
        """
        with self.state.lock:
            handle = self.state.holders.get(base_name)
        if handle is None or handle.pid is None:
            raise KeyError(f"no base holder for {base_name!r}: no LoRA model of it was created yet")
        fut = Future(request_id=self.state.new_id("info"), tenant="(service)", kind="BaseInfo")
        handle.submit(fut, "info", {"checksum": checksum}, lambda result: fut.succeed(json=result))
        if not fut.done.wait(timeout_s):
            raise TimeoutError(f"base holder of {base_name!r} did not answer within {timeout_s:.0f} s")
        if fut.error is not None:
            raise RuntimeError(fut.error)
        return {"pid": handle.pid, **(fut.json or {})}

    def worker_starts(self) -> dict[str, dict[str, float]]:
        """Where each started worker's (and base holder's) start went, in seconds: spawn, import, setup, total."""
        with self.state.lock:
            handles = [*self.state.workers.values(), *self.state.batchers.values(), *self.state.holders.values()]
        return {h.name: dict(h.start_s) for h in handles if h.start_s}

    def unit_timings(self) -> list[dict[str, Any]]:
        """Every finished work unit still kept (``future_ttl_s``): tenant, kind, request id, stamps and breakdown.

        For benchmarks: see :func:`rota_tinker._http.handles.unit_breakdown` for what each part means.
        """
        with self.state.lock:
            futures = list(self.state.futures.values())
        return [{"tenant": f.tenant, "kind": f.kind, "request_id": f.request_id, "failed": f.error is not None,
                 "submitted": f.timing.get("submitted"), "answered": f.timing.get("answered"),
                 **unit_breakdown(f.timing)} for f in futures if f.done.is_set() and "done" in f.timing]

    def stop(self) -> list[str]:
        """Stop serving; stop every tenant worker and wait for them, then the base holders (producers last).

        Workers release their turn and drop shared bases before exiting; one that does not exit
        within ``stop_timeout_s`` is killed. Returns the names of those killed (normally none).
        With ``farewell_s``, live sessions first get their heartbeats answered 410 (see :meth:`_farewell`).
        """
        self._farewell()
        self._http.shutdown()
        self.api.pool.shutdown(wait=False, cancel_futures=True)
        with self.state.lock:
            consumers = [*self.state.workers.values(), *self.state.batchers.values()]
            holders = list(self.state.holders.values())
        killed = close_all(consumers, self.config.stop_timeout_s)
        killed += close_all(holders, self.config.stop_timeout_s)
        if killed:
            log.warning("stopped; killed %s (they did not exit within %.0f s)", killed, self.config.stop_timeout_s)
        self._orchestrator.close()
        return killed

    def _farewell(self) -> None:
        """Answer the heartbeats of sessions seen in the last 30 s with 410 until each has had it, for at most
        ``farewell_s``: their SDKs then stop heart-beating (they would warn every 10 s, forever, at a closed port)."""
        if self.config.farewell_s <= 0:
            return
        now = time.monotonic()
        with self.state.lock:
            live = {sid for sid, s in self.state.sessions.items() if now - s.last_seen < 30.0}
            self.state.stopping = True
        if not live:
            return
        log.info("saying farewell to %d live sessions (up to %g s, --farewell)", len(live), self.config.farewell_s)
        deadline = now + self.config.farewell_s
        while time.monotonic() < deadline:
            with self.state.lock:
                if live <= self.state.farewelled:
                    return
            time.sleep(0.1)

    def __enter__(self) -> TinkerService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
