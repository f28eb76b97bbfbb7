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
import itertools
import logging
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rota_tinker._config import STATE_BYTES_PER_PARAM, BaseModelSpec, ServiceConfig, Tenant
from rota_tinker._hf import HfModelSpec
from rota_tinker._http import audit as _audit
from rota_tinker._http import checkpoints as _checkpoints
from rota_tinker._http import external as _external
from rota_tinker._http import formats as _formats
from rota_tinker._http import projects as _projects
from rota_tinker._http import trace as _trace
from rota_tinker._http import usage as _usage
from rota_tinker._http.formats import CONFLICT, NOT_IMPLEMENTED, BadRequest, QuotaExceeded, field_of
from rota_tinker._http.handles import Future, WorkerHandle, close_all, unit_breakdown
from rota_tinker._http.server import HttpServer, Reply, Request
from rota_tinker._http.stability import StabilityRecords
from rota_tinker._worker.main import WorkerSpec
from rota_tinker._worker.state_files import private_dir

log = logging.getLogger(__name__)

PROTO = "application/x-protobuf"
_NAME = _checkpoints.NAME  # checkpoint names: they become file names
_ID = _checkpoints.ID
_PATH = re.compile(rf"tinker://({_ID})/sampler_weights/({_ID})")
MAX_SAMPLES = 64
MAX_TOPK = 1000  # top-k, target ids per position and alternative tokens a sample request may ask for
MAX_NEW_TOKENS = 1024
SEED_BOUNDS = (0, 2**63 - 1)
# a model's newest ephemeral sampler weights kept; older ones are deleted (an RL loop saves one every step)
EPHEMERAL_KEEP = 4
BATCH_UNITS_PER_TURN = 4096  # the batched LoRA worker runs every unit queued when its turn starts (a bound)

# The flags this server answers /client/config with: API keys only (no JWT exchange),
# the plain httpx transport, uncompressed protobuf forward_backward bodies.
# The SDK's byte estimate of a datum (tinker TrainingClient): 4 per input token plus its loss inputs,
# of which target_tokens (int64, one per token) is always there.
SDK_BYTES_PER_TOKEN = 4 + 8
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


@dataclass
class _Session:
    session_id: str
    tenant: str
    last_seen: float  # monotonic: created, or its last heartbeat
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    project_id: str | None = None  # rota_tinker._http.projects
    created: float = field(default_factory=time.time)


@dataclass
class _Model:
    model_id: str
    tenant: str
    base: BaseModelSpec
    lora: dict[str, Any] | None
    session_id: str
    bytes: int  # estimated state: weights, grads, Adam moments (and a private base)
    ephemeral: list[str] = field(default_factory=list)  # tinker paths of its ephemeral weights, oldest first


@dataclass
class _Weights:
    path: str
    tenant: str
    base: BaseModelSpec
    file: str  # its folder (rota_tinker._worker.state_files): the sampler's key, the archive's content
    lora: bool  # adapter weights (they go on the shared base), or a full model
    bytes: int  # its files' size
    ephemeral: bool = False  # saved for a sampling client only (not listed as a checkpoint)
    created: float = field(default_factory=time.time)
    user_metadata: dict[str, str] | None = None
    expires: float | None = None  # wall clock (ttl_seconds, set_checkpoint_ttl); None: never
    public: bool = False


@dataclass
class _SamplingSession:
    session_id: str
    tenant: str
    base: BaseModelSpec
    key: str  # weights folder, or "base:NAME"
    model_path: str | None
    shareable: bool  # adapter weights or the bare base: sampled on the shared base
    parent: str  # the training session it was made in (it ends with it)


class _State:
    """Everything the service knows; guarded by one lock (requests are short)."""

    def __init__(self, config: ServiceConfig, endpoint: str | None) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.sessions: dict[str, _Session] = {}
        # sessions that ended (heartbeats then get 410), the latest per tenant, so the SDK stops heart-beating
        self.finished: dict[str, OrderedDict[str, str]] = {t.name: OrderedDict() for t in config.tenants}
        self.models: dict[str, _Model] = {}
        self.creating: dict[str, _Model] = {}  # create_model accepted, the worker not done yet (counts for quotas)
        self.weights: dict[str, _Weights] = {}  # tinker:// path -> weights
        self.runs = _checkpoints.Runs()  # training runs and training checkpoints (save_state)
        self.usage_counts = _usage.Usage()  # tokens and checkpoints by the hour (get_billing_usage)
        self.sampling: dict[str, _SamplingSession] = {}
        self.stability = StabilityRecords()  # samples recorded for stable_reinforce (record_stability_info)
        self.futures: dict[str, Future] = {}
        self.future_session: dict[str, str] = {}  # request id -> its session (for session traces)
        self._last_prune = 0.0
        self._last_sweep = 0.0
        self.stopping = False  # stop() is saying farewell: heartbeats answer 410 (TinkerService.stop)
        self.farewelled: set[str] = set()  # sessions whose heartbeat got that answer
        self.forgotten_futures = 0  # finished futures dropped after future_ttl_s
        self.counter = itertools.count(1)
        self.workers: dict[tuple[str, str], WorkerHandle] = {}
        for t in config.tenants:
            for role in ("trainer", "sampler"):
                spec = WorkerSpec(tenant=t.name, role=role, group=config.group, endpoint=endpoint,
                                  device=config.device, data_dir=config.data_dir, torch_threads=config.torch_threads,
                                  units_per_turn=config.units_per_turn, release_cached=config.release_cached,
                                  deterministic=config.deterministic, lora_concurrency=config.lora_concurrency)
                self.workers[(t.name, role)] = WorkerHandle(spec, config.worker_start_timeout_s)
        self.holders: dict[str, WorkerHandle] = {}  # base name -> its holder on config.device
        self.batchers: dict[str, WorkerHandle] = {}  # base name -> its batched LoRA worker (config.lora_batch)
        self.endpoint = endpoint  # a holder with a LoRA pool takes turns there (rota_tinker._worker.pool)

    def holder(self, base: BaseModelSpec) -> WorkerHandle:
        """The base-holder process of ``base`` on the service's device (made on first use, started by ``ensure``)."""
        with self.lock:
            handle = self.holders.get(base.name)
            if handle is None:
                spec = WorkerSpec(tenant=f"{base.name}@{self.config.device}", role="base", group=self.config.group,
                                  endpoint=self.endpoint, device=self.config.device, data_dir=self.config.data_dir,
                                  torch_threads=self.config.torch_threads, base=base,
                                  lora_concurrency=self.config.lora_concurrency,
                                  pool_job=f"lora-pool.{len(self.holders)}")
                handle = self.holders[base.name] = WorkerHandle(spec, self.config.worker_start_timeout_s)
        return handle

    def trainer_of(self, m: _Model) -> WorkerHandle:
        """The worker that holds model ``m``: with ``lora_batch`` a LoRA model is in its base's batched worker
        (rota_tinker._worker.batch, made on first use), anything else in its tenant's trainer."""
        if self.config.lora_batch and m.lora is not None:
            return self.batcher(m.base)
        return self.workers[(m.tenant, "trainer")]

    def sampler_of(self, tenant: str, base: BaseModelSpec, shareable: bool) -> WorkerHandle:
        """Where a sample runs: with ``lora_batch``, samples on the shared base (LoRA weights or the bare base) decode
        in its batched worker, many tenants' rows in one batch; others in the tenant's sampler."""
        if self.config.lora_batch and shareable and self.config.share_lora_base:
            return self.batcher(base)
        return self.workers[(tenant, "sampler")]

    def batcher(self, base: BaseModelSpec) -> WorkerHandle:
        """The batched LoRA worker of ``base`` (made on first use, started by its first unit)."""
        with self.lock:
            handle = self.batchers.get(base.name)
            if handle is None:
                spec = WorkerSpec(tenant=f"lora-batch.{len(self.batchers)}", role="batch", group=self.config.group,
                                  endpoint=self.endpoint, device=self.config.device, data_dir=self.config.data_dir,
                                  torch_threads=self.config.torch_threads, units_per_turn=BATCH_UNITS_PER_TURN,
                                  deterministic=self.config.deterministic,
                                  lora_batch_tokens=self.config.lora_batch_tokens)
                handle = self.batchers[base.name] = WorkerHandle(spec, self.config.worker_start_timeout_s)
        return handle

    def _forget_everywhere(self, tenant: str, base: BaseModelSpec, key: str) -> None:
        """Let the tenant's sampler (if running) and the base's batched worker (if any) drop weights ``key``."""
        with self.lock:
            handles = [self.workers[(tenant, "sampler")], self.batchers.get(base.name)]
        for handle in handles:
            if handle is not None and handle.pid is not None:
                fut = self.future(tenant, "ForgetWeights")
                handle.submit(fut, "forget", {"key": key}, lambda _r, fut=fut: fut.succeed(json={}))

    def shared_base(self, base: BaseModelSpec, shareable: bool) -> str | None:
        """The address workers fetch ``base`` from, or None (sharing is off, or a full model needs its own copy).

        :raises RuntimeError: the holder could not start (the caller fails its future with it).
        """
        if not (shareable and self.config.share_lora_base):
            return None
        return str(self.holder(base).ensure()["address"])

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self.counter)}-{secrets.token_hex(4)}"

    def future(self, tenant: str, kind: str, session: str | None = None) -> Future:
        """A new request's future; ``session``: the session it belongs to (its trace, rota_tinker._http.trace)."""
        fut = Future(request_id=self.new_id("req"), tenant=tenant, kind=kind)
        with self.lock:
            self._forget_old_futures()
            self.futures[fut.request_id] = fut
            if session is not None:
                self.future_session[fut.request_id] = session
        return fut

    def _forget_old_futures(self) -> None:
        """Drop futures finished more than ``future_ttl_s`` ago (at most one scan a second; lock held)."""
        now = time.monotonic()
        if now - self._last_prune < 1.0:
            return
        self._last_prune = now
        cutoff = now - self.config.future_ttl_s
        old = [rid for rid, f in self.futures.items() if f.finished_at is not None and f.finished_at < cutoff]
        for rid in old:
            del self.futures[rid]
            self.future_session.pop(rid, None)
            self.forgotten_futures += 1

    # ------------------------------------------------------------ quotas

    def usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds now: live models (and those being created), sessions, bytes (lock held)."""
        models = [m for m in (*self.models.values(), *self.creating.values()) if m.tenant == tenant]
        sessions = sum(s.tenant == tenant for s in self.sessions.values())
        sessions += sum(s.tenant == tenant for s in self.sampling.values())
        nbytes = sum(m.bytes for m in models) + sum(w.bytes for w in self.weights.values() if w.tenant == tenant)
        nbytes += self.runs.bytes_of(tenant)
        return {"models": len(models), "sessions": sessions, "bytes": nbytes}

    def check_quota(self, tenant: str, *, models: int = 0, sessions: int = 0, nbytes: int = 0) -> None:
        """Raise QuotaExceeded (429) when adding this much would take ``tenant`` past a quota (lock held)."""
        have = self.usage(tenant)
        c = self.config
        if models and have["models"] + models > c.max_models:
            raise QuotaExceeded(f"tenant {tenant} already holds {have['models']} models, the most one key may "
                                f"hold (max_models={c.max_models}); unload one (POST /api/v1/unload_model) or "
                                "finish the session that made it (ServiceClient.close())")
        if sessions and have["sessions"] + sessions > c.max_sessions:
            raise QuotaExceeded(f"tenant {tenant} already has {have['sessions']} live sessions (training and "
                                f"sampling), the most one key may hold (max_sessions={c.max_sessions}); finish one "
                                "(ServiceClient.close()) or let idle ones expire")
        if nbytes and have["bytes"] + nbytes > c.max_bytes:
            raise QuotaExceeded(f"tenant {tenant} holds {have['bytes']} bytes of models and saved weights; {nbytes} "
                                f"more would pass max_bytes={c.max_bytes}; unload a model (POST "
                                "/api/v1/unload_model) or delete saved weights "
                                "(RestClient.delete_checkpoint_from_tinker_path)")

    # ------------------------------------------------------------ freeing

    def sweep(self) -> bool:
        """End sessions whose heartbeats stopped ``session_ttl_s`` ago (at most one scan a second: True when this
        call scanned)."""
        now = time.monotonic()
        with self.lock:
            if now - self._last_sweep < 1.0:
                return False
            self._last_sweep = now
            stale = [s.session_id for s in self.sessions.values() if now - s.last_seen > self.config.session_ttl_s]
        for sid in stale:
            self.end_session(sid, f"no heartbeat for {self.config.session_ttl_s:g} s")
        return True

    def end_session(self, sid: str, why: str) -> None:
        """End a session: its sampling sessions end and its models are unloaded (their quota freed at once)."""
        with self.lock:
            session = self.sessions.pop(sid, None)
            if session is None:
                return
            done = self.finished[session.tenant]
            done[sid] = session.tenant
            while len(done) > self.config.max_sessions:
                done.popitem(last=False)
            for ssid in [k for k, s in self.sampling.items() if s.parent == sid]:
                del self.sampling[ssid]
            models = [m for m in self.models.values() if m.session_id == sid]
        self.stability.end_session(sid)
        log.info("tenant %s: session %s ended (%s); unloading %d model(s)", session.tenant, sid, why, len(models))
        for m in models:
            self.unload(m, self.future(m.tenant, "UnloadModel"))

    def unload(self, m: _Model, fut: Future) -> None:
        """Forget model ``m`` and its ephemeral weights; its trainer drops it in its next turn."""
        with self.lock:
            self.models.pop(m.model_id, None)
        for path in list(m.ephemeral):
            self.delete_weights(path)
        self.trainer_of(m).submit(
            fut, "unload", {"model_id": m.model_id},
            lambda _result: fut.succeed(json={"model_id": m.model_id, "type": "unload_model"}))

    def delete_weights(self, path: str) -> None:
        """Delete saved sampler weights: their folder, the sampling sessions on them, the sampler's copy."""
        with self.lock:
            w = self.weights.pop(path, None)
            if w is None:
                return
            for ssid in [k for k, s in self.sampling.items() if s.model_path == path]:
                del self.sampling[ssid]
        shutil.rmtree(w.file, ignore_errors=True)
        if self.batchers:
            self._forget_everywhere(w.tenant, w.base, w.file)
            return
        fut = self.future(w.tenant, "ForgetWeights")
        self.workers[(w.tenant, "sampler")].submit(fut, "forget", {"key": w.file}, lambda _r: fut.succeed(json={}))


    def forget_checkpoint(self, tenant: str, path: str, folder: str, base: BaseModelSpec | None = None) -> None:
        """A training checkpoint deleted or expired: the sampling sessions on it end, a running sampler lets its copy
        go (sampler weights go through delete_weights)."""
        with self.lock:
            for ssid in [k for k, s in self.sampling.items() if s.model_path == path]:
                del self.sampling[ssid]
        if base is not None and self.batchers:
            self._forget_everywhere(tenant, base, folder)
            return
        handle = self.workers[(tenant, "sampler")]
        if handle.pid is not None:
            fut = self.future(tenant, "ForgetWeights")
            handle.submit(fut, "forget", {"key": folder}, lambda _r: fut.succeed(json={}))


def _start_quietly(handle: WorkerHandle) -> None:
    """Start a worker ahead of its first unit; a failure is kept by the handle and fails that unit instead."""
    with contextlib.suppress(RuntimeError):
        handle.ensure()


MAX_STOPS = 16
MAX_STOP_CHARS = 256


def _stops(stop: Any, base: BaseModelSpec | HfModelSpec) -> tuple[list[int], list[str]]:
    """``SamplingParams.stop`` -> (stop token ids, stop strings).

    ``None``: the model's end-of-sequence tokens; ``[]``: no stop; a string or a list of strings:
    matched on the decoded text by the model's own tokenizer; a list of ids: those tokens.
    """
    if stop is None:
        return list(getattr(base, "eos_ids", ())), []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list) or len(items) > MAX_STOPS:
        raise BadRequest(f"sampling_params.stop must be a string or a list of at most {MAX_STOPS} strings or token "
                         "ids")
    if all(isinstance(s, str) for s in items) and items:
        if getattr(base, "tokenizer_id", None) is None:
            raise BadRequest(f"sampling_params.stop as strings needs a tokenizer; base model {base.name!r} has none "
                             "in its folder: give stop token ids (a list of integers)")
        bad = [i for i, s in enumerate(items) if not 1 <= len(s) <= MAX_STOP_CHARS]
        if bad:
            raise BadRequest(f"sampling_params.stop[{bad[0]}] must have 1-{MAX_STOP_CHARS} characters")
        return [], list(items)
    for i, s in enumerate(items):
        if not isinstance(s, int) or isinstance(s, bool) or not 0 <= s < base.vocab:
            raise BadRequest(f"sampling_params.stop[{i}] is {str(s)[:40]!r}: give all strings or all token ids of the "
                             f"base model's vocabulary of {base.vocab} tokens [0, {base.vocab})")
    return list(items), []


def _json(obj: Any, status: int = 200) -> Reply:
    return Reply.json(obj, status)


class _Api(_checkpoints.CheckpointRoutes, _external.ExternalRoutes, _projects.ProjectRoutes, _audit.AuditRoutes,
           _usage.UsageRoutes, _trace.TraceRoutes):
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

    # ------------------------------------------------------------ training routes

    def _base(self, name: Any) -> BaseModelSpec | HfModelSpec:
        spec = self.config.base_models.get(name) if isinstance(name, str) else None
        if spec is None:
            shown = repr(name[:140]) if isinstance(name, str) else type(name).__name__
            searched = (f"; searched {list(self.config.model_dirs)} for Hugging Face snapshots (hub cache "
                        "models--ORG--NAME/snapshots/REV or plain folders ORG/NAME with config.json; nothing is "
                        "downloaded: put the snapshot in one of them)") if self.config.model_dirs else ""
            raise BadRequest(f"base_model {shown} is not served here; choose one of {sorted(self.config.base_models)}"
                             f"{searched}", status=404)
        return spec

    def _model_bytes(self, base: BaseModelSpec | HfModelSpec, lora: dict[str, Any] | None) -> int:
        """Estimated state of a model: 16 bytes per trainable parameter, plus 4 per parameter of a private base."""
        if lora is None:
            return STATE_BYTES_PER_PARAM * base.params()
        private = 0 if self.config.share_lora_base else 4 * base.params()
        return STATE_BYTES_PER_PARAM * base.lora_params(lora["rank"], lora["targets"]) + private

    def _create_model(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        sid = self._session(tenant, body)
        field_of(body, "model_seq_id", int)
        base = self._base(field_of(body, "base_model", str))
        opt = field_of(body, "optimizer_config", dict, required=False, default={"type": "adamw"})
        if opt.get("type", "adamw") != "adamw":
            raise BadRequest("optimizer_config type is not implemented by this service; use adamw (the default)",
                             status=NOT_IMPLEMENTED)
        lora_cfg = field_of(body, "lora_config", dict, required=False)
        lora = None
        if lora_cfg is not None:
            rank = field_of(lora_cfg, "rank", int, bounds=(1, min(256, base.dim)))
            seed = field_of(lora_cfg, "seed", int, required=False, bounds=SEED_BOUNDS)
            targets = {g: field_of(lora_cfg, f"train_{g}", bool, required=False, default=True)
                       for g in ("mlp", "attn", "unembed")}
            if not any(targets.values()):
                raise BadRequest("lora_config trains nothing; set at least one of train_mlp, train_attn, "
                                 "train_unembed")
            lora = {"rank": rank, "seed": secrets.randbelow(2**31) if seed is None else seed, "targets": targets}
        model_id = self.state.new_id(f"{tenant.name}-model")
        fut = self._start_model(tenant, sid, model_id, base, lora, _checkpoints.user_metadata(
            body.get("user_metadata")), {"model_id": model_id, "type": "create_model"})
        return self._future_reply(fut, model_id)

    def _start_model(self, tenant: Tenant, sid: str, model_id: str, base: BaseModelSpec | HfModelSpec,
                     lora: dict[str, Any] | None, metadata: dict[str, str] | None, answer: dict[str, Any],
                     load: dict[str, Any] | None = None) -> Future:
        """Create model ``model_id`` in the tenant's trainer (from checkpoint ``load`` if given); its future."""
        state = self.state
        model = _Model(model_id, tenant.name, base, lora, sid, self._model_bytes(base, lora))
        with state.lock:
            if model_id in state.models or model_id in state.creating:
                raise BadRequest(f"model {model_id[:140]!r} exists already; use a new model_seq_id", status=CONFLICT)
            state.check_quota(tenant.name, models=1, nbytes=model.bytes)
            state.creating[model_id] = model
        fut = state.future(tenant.name, "CreateModel", sid)
        trainer = state.trainer_of(model)

        def done(result: Any) -> None:
            with state.lock:
                state.creating.pop(model_id, None)
                live = sid in state.sessions
                if live:
                    state.models[model_id] = model
                    state.runs.record(model, metadata, state.sessions[sid].project_id)
            if not live:  # its session ended meanwhile: nothing may keep the model
                state.unload(model, state.future(tenant.name, "UnloadModel"))
            fut.succeed(json=answer)

        def failed() -> None:
            with state.lock:
                state.creating.pop(model_id, None)

        fut.add_done_callback(lambda: failed() if fut.error is not None else None)

        def start() -> None:
            """Off the request thread (starting processes takes seconds): the trainer starts beside the holder."""
            try:
                threading.Thread(target=_start_quietly, args=(trainer,), name=f"rota-tinker-start-{trainer.name}",
                                 daemon=True).start()
                try:
                    shared = state.shared_base(base, lora is not None)
                except RuntimeError as e:
                    fut.fail(f"the shared base {base.name!r} is not available: {e}", "server")
                    return
                args = {"model_id": model_id, "base": base, "lora": lora, "shared_base": shared, "load": load}
                if trainer.spec.role == "batch":  # it holds many tenants' models: their folders are named by tenant
                    args["tenant"] = tenant.name
                trainer.submit(fut, "create", args, done, restart=True)
            except Exception as e:  # never leave the future pending
                log.exception("create_model %s failed to start", model_id)
                fut.fail(f"create_model could not start: {type(e).__name__}", "server")

        threading.Thread(target=start, name=f"rota-tinker-create-{model_id}", daemon=True).start()
        log.info("tenant %s: model %s (%s, %s%s)", tenant.name, model_id, base.name,
                 f"lora rank {lora['rank']}" if lora else "full-parameter", ", from a checkpoint" if load else "")
        return fut

    def _unload_model(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        """Free a model and its ephemeral sampler weights: the quota at once, the memory in its trainer's next turn."""
        m = self._model(tenant, field_of(body, "model_id", str))
        fut = self.state.future(tenant.name, "UnloadModel")
        self.state.unload(m, fut)
        log.info("tenant %s: unload_model %s", tenant.name, m.model_id)
        return self._future_reply(fut, m.model_id)

    def _get_info(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        m = self._model(tenant, field_of(body, "model_id", str))
        hf = isinstance(m.base, HfModelSpec)
        return _json({"type": "get_info", "model_id": m.model_id, "model_name": m.base.name,
                      "is_lora": m.lora is not None, "lora_rank": m.lora["rank"] if m.lora else None,
                      "model_data": {"arch": "hf-causal-lm" if hf else "rota-tinylm", "model_name": m.base.name,
                                     "tokenizer_id": m.base.tokenizer_id if hf else None}})

    def _forward_backward(self, req: Request, tenant: Tenant, body: bytes) -> Reply:
        ctype = req.header("content-type").split(";")[0].strip().lower()
        if ctype != PROTO:
            raise BadRequest(f"forward_backward takes Content-Type {PROTO} (the tinker SDK's "
                             f"ForwardBackwardRequest protobuf), not {ctype[:60] or '(none)'!r}", status=415)
        fb = _formats.parse_forward_backward(_formats.decompress(body, req.header("content-encoding"),
                                                                 self.config.max_body_bytes))
        m = self._model(tenant, fb.model_id)
        tokens = sum(d.tokens.size for d in fb.data)
        if tokens > self.config.max_request_tokens:
            raise BadRequest(f"this request carries {tokens} tokens over its {len(fb.data)} data; the service takes "
                             f"at most {self.config.max_request_tokens} per forward/forward_backward request "
                             "(--max-request-tokens): split the batch into several requests (the tinker SDK "
                             "does so by itself)")
        data = []
        for i, d in enumerate(fb.data):
            _formats.token_ids(d.tokens, m.base.vocab, f"data[{i}].model_input")
            inputs = {**d.inputs, "target_tokens": _formats.token_ids(d.inputs["target_tokens"], m.base.vocab,
                                                                      f"data[{i}].loss_fn_inputs['target_tokens']")}
            if d.tokens.size > m.base.max_len:
                raise BadRequest(f"data[{i}] has {d.tokens.size} tokens; base model {m.base.name!r} takes at most "
                                 f"{m.base.max_len}")
            if fb.loss_fn == "stable_reinforce":  # the sampler's records, checked against the datum's provenance
                inputs = self.state.stability.loss_inputs(tenant.name, m.session_id, i, d.tokens, inputs,
                                                          d.provenance)
            data.append((d.tokens, inputs))
        fut = self.state.future(tenant.name, "ForwardBackward", m.session_id)

        def done(result: Any) -> None:
            self.state.usage_counts.note(tenant.name, "training", tokens, m.base.name, m.session_id)
            fut.succeed(proto=_formats.forward_backward_output(result["logprobs"], result["metrics"]))

        self.state.trainer_of(m).submit(
            fut, "forward_backward",
            {"model_id": m.model_id, "loss_fn": fb.loss_fn, "forward_only": fb.forward_only, "data": data,
             "loss_config": fb.loss_config}, done)
        return self._future_reply(fut, m.model_id)

    def _optim_step(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        m = self._model(tenant, field_of(body, "model_id", str))
        if body.get("optimizer_params") is not None:
            raise BadRequest("optimizer_params (non-Adam optimizers) are not implemented by this service; send "
                             "AdamParams", status=NOT_IMPLEMENTED)
        p = field_of(body, "adam_params", dict)
        adam = {k: field_of(p, k, float, required=False, default=d) for k, d in
                (("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-12), ("weight_decay", 0.0),
                 ("grad_clip_norm", 0.0))}
        if adam["learning_rate"] < 0 or adam["eps"] <= 0 or adam["weight_decay"] < 0 or adam["grad_clip_norm"] < 0:
            raise BadRequest(f"adam_params {adam} out of range: learning_rate, weight_decay and grad_clip_norm must "
                             "be >= 0 and eps > 0")
        if not (0 <= adam["beta1"] < 1 and 0 <= adam["beta2"] < 1):
            raise BadRequest(f"adam_params beta1={adam['beta1']}, beta2={adam['beta2']} must be within [0, 1)")
        fut = self.state.future(tenant.name, "OptimStep", m.session_id)
        self.state.trainer_of(m).submit(
            fut, "optim_step", {"model_id": m.model_id, "adam": adam},
            lambda result: fut.succeed(json={"metrics": result["metrics"]}))
        return self._future_reply(fut, m.model_id)

    def _save_for_sampler(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        state = self.state
        m = self._model(tenant, field_of(body, "model_id", str))
        name = field_of(body, "path", str, required=False)
        ephemeral = name is None
        if name is None:
            field_of(body, "sampling_session_seq_id", int)
            name = f"ephemeral-{secrets.token_hex(6)}"
        elif not _NAME.fullmatch(name):
            raise BadRequest(f"path {name[:80]!r} is not a valid checkpoint name: use 1-64 letters, digits, '.', '_', "
                             "'-', starting with a letter or digit")
        tinker_path = f"tinker://{m.model_id}/sampler_weights/{name}"
        expires = _checkpoints.ttl(body)
        metadata = _checkpoints.user_metadata(body.get("user_metadata"))
        nbytes = 4 * (m.base.params() if m.lora is None else m.base.lora_params(m.lora["rank"], m.lora["targets"]))
        with state.lock:
            if tinker_path in state.weights:
                raise BadRequest(f"{tinker_path} exists; save under another name or delete it first", status=CONFLICT)
            state.check_quota(tenant.name, nbytes=nbytes, sessions=1 if ephemeral else 0)
        fut = state.future(tenant.name, "SaveWeightsForSampler", m.session_id)

        def done(result: Any) -> None:
            w = _Weights(tinker_path, tenant.name, m.base, result["file"], m.lora is not None, int(result["bytes"]),
                         ephemeral, user_metadata=metadata, expires=expires)
            older: list[str] = []
            with state.lock:
                state.weights[tinker_path] = w
                if ephemeral:
                    m.ephemeral.append(tinker_path)
                    older, m.ephemeral[:] = m.ephemeral[:-EPHEMERAL_KEEP], m.ephemeral[-EPHEMERAL_KEEP:]
            for path in older:
                state.delete_weights(path)
            if ephemeral:
                sid = self._new_sampling_session(tenant, m.base, w.file, tinker_path, w.lora, m.session_id)
                fut.succeed(json={"type": "save_weights_for_sampler", "sampling_session_id": sid})
            else:
                state.runs.audit.note(tenant.name, "checkpoint_create", tinker_path=tinker_path, model_id=m.model_id)
                state.usage_counts.note(tenant.name, "checkpoint", 1, m.base.name, m.session_id)
                fut.succeed(json={"type": "save_weights_for_sampler", "path": tinker_path})

        state.trainer_of(m).submit(
            fut, "save_for_sampler", {"model_id": m.model_id, "name": name, "base": m.base}, done)
        return self._future_reply(fut, m.model_id)

    # ------------------------------------------------------------ sampling routes

    def _new_sampling_session(self, tenant: Tenant, base: BaseModelSpec, key: str, model_path: str | None,
                              shareable: bool, parent: str) -> str:
        state = self.state
        sid = state.new_id(f"{tenant.name}-sampler")
        with state.lock:
            state.sampling[sid] = _SamplingSession(sid, tenant.name, base, key, model_path, shareable, parent)
        return sid

    @staticmethod
    def copied_weights(item: _Weights, path: str, folder: str, expires: float | None) -> _Weights:
        """Sampler weights copied by copy_weights (rota_tinker._http.projects): the same weights in another folder."""
        return _Weights(path, item.tenant, item.base, folder, item.lora, item.bytes, expires=expires)

    def _weights_for(self, tenant: Tenant, model_path: str) -> _Weights:
        """The weights a sampler loads for ``model_path``: sampler weights, or a training checkpoint (its folder
        holds the same files plus the optimizer state, which the sampler does not read)."""
        if _checkpoints.TRAINING_PATH.fullmatch(model_path):
            ck = self._checkpoint(tenant, model_path)
            return _Weights(ck.path, ck.tenant, ck.base, ck.folder, ck.lora is not None, ck.bytes, ephemeral=True)
        if not _PATH.fullmatch(model_path):
            raise BadRequest(f"model_path {model_path[:140]!r} is not a weights path; use the path "
                             "save_weights_for_sampler or save_state returned (tinker://MODEL/sampler_weights/NAME or "
                             "tinker://MODEL/weights/NAME)")
        w = self._owned(self.state.weights, model_path, "sampler weights", tenant)
        if _checkpoints.expired(w):
            raise BadRequest(f"sampler weights {model_path!r} have expired (their TTL passed)", status=404)
        return w

    def _create_sampling_session(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        parent = self._session(tenant, body)
        field_of(body, "sampling_session_seq_id", int)
        model_path = field_of(body, "model_path", str, required=False)
        base_name = field_of(body, "base_model", str, required=False)
        if model_path is not None:
            w = self._weights_for(tenant, model_path)
            if base_name is not None and base_name != w.base.name:
                raise BadRequest(f"base_model {base_name[:140]!r} differs from {w.base.name!r} of {model_path!r}; "
                                 "leave base_model out")
            base, key, shareable = w.base, w.file, w.lora
        elif base_name is not None:
            base = self._base(base_name)
            key, shareable = f"base:{base.name}", True
        else:
            raise BadRequest("give model_path (weights saved for the sampler) or base_model")
        with self.state.lock:
            self.state.check_quota(tenant.name, sessions=1)
        sid = self._new_sampling_session(tenant, base, key, model_path, shareable, parent)
        return _json({"type": "create_sampling_session", "sampling_session_id": sid})

    def _get_sampler(self, tenant: Tenant, sampler_id: str) -> Reply:
        s = self._owned(self.state.sampling, sampler_id, "sampler", tenant)
        return _json({"sampler_id": s.session_id, "base_model": s.base.name, "model_path": s.model_path})

    def _asample(self, tenant: Tenant, body: dict[str, Any]) -> Reply:
        state = self.state
        sid = field_of(body, "sampling_session_id", str, required=False)
        session = None
        if sid is not None:
            field_of(body, "seq_id", int)
            s = self._owned(state.sampling, sid, "sampling session", tenant)
            base, key, shareable, session = s.base, s.key, s.shareable, s.parent
        elif body.get("model_path") is not None:
            w = self._weights_for(tenant, field_of(body, "model_path", str))
            base, key, shareable = w.base, w.file, w.lora
        else:
            base = self._base(field_of(body, "base_model", str))
            key, shareable = f"base:{base.name}", True
        record = field_of(body, "record_stability_info", bool, required=False, default=False)
        if record and session is None:
            raise BadRequest("record_stability_info=true is taken only with a sampling_session_id (records belong "
                             "to the training session that sampled them): sample through the SDK's SamplingClient, "
                             "which makes one")
        num = field_of(body, "num_samples", int, required=False, default=1, bounds=(1, MAX_SAMPLES))
        prompt = _formats.prompt_tokens(body.get("prompt"), base.vocab)
        if prompt.size >= base.max_len:
            raise BadRequest(f"prompt has {prompt.size} tokens; base model {base.name!r} takes fewer than "
                             f"{base.max_len}")
        outputs = self._prompt_outputs(body, prompt.size, base.vocab)
        sp = field_of(body, "sampling_params", dict)
        params = self._sampling_params(sp, base)
        params.update(outputs)
        seed = params.pop("seed")
        seed = secrets.randbelow(2**31) if seed is None else seed
        fut = state.future(tenant.name, "Sample", session)
        seq_ids = [f"{fut.request_id}:{i}" for i in range(num)]
        try:
            shared = state.shared_base(base, shareable)
        except RuntimeError as e:
            fut.fail(f"the shared base {base.name!r} is not available: {e}", "server")
            return self._future_reply(fut, None, sample_sequence_ids=seq_ids)
        state.sampler_of(tenant.name, base, shareable).submit(
            fut, "sample", {"key": key, "base": base, "prompt": prompt, "params": params, "num_samples": num,
                            "seed": seed, "shared_base": shared},
            lambda result: self._sampled(fut, tenant, result, prompt.size, base.name, session,
                                         (seq_ids, prompt) if record else None), restart=True)
        return self._future_reply(fut, None, sample_sequence_ids=seq_ids)

    def _sampled(self, fut: Future, tenant: Tenant, result: dict[str, Any], prompt_len: int, base: str,
                 session: str | None, record: tuple[list[str], Any] | None = None) -> None:
        if record is not None and session is not None:  # record_stability_info: kept for stable_reinforce
            seq_ids, prompt = record
            self.state.stability.record(tenant.name, session, seq_ids, prompt,
                                        [(seq[0], seq[1]) for seq in result["sequences"]])
        usage = self.state.usage_counts
        usage.note(tenant.name, "sampling_prefill", prompt_len, base, session)
        usage.note(tenant.name, "sampling_sample", sum(len(seq[0]) for seq in result["sequences"]), base, session)
        fut.succeed(proto=_formats.sample_response(result))

    @staticmethod
    def _prompt_outputs(body: dict[str, Any], prompt_len: int, vocab: int) -> dict[str, Any]:
        """The outputs a sample request asks for besides its samples (see rota_tinker._worker.sampling.sample)."""
        out: dict[str, Any] = {"prompt_logprobs": field_of(body, "prompt_logprobs", bool, required=False,
                                                           default=False)}
        for wire, key in (("topk_prompt_logprobs", "topk_prompt"), ("topk_sample_logprobs", "topk_sample"),
                          ("prompt_alt_tokens_k", "alt_k")):
            out[key] = field_of(body, wire, int, required=False, default=0, bounds=(0, MAX_TOPK))
        if (out["topk_prompt"] or out["alt_k"]) and prompt_len < 2:
            raise BadRequest("topk_prompt_logprobs and prompt_alt_tokens_k need a prompt of at least 2 tokens")
        last_n = field_of(body, "prompt_logprobs_last_n", int, required=False, bounds=(1, max(1, prompt_len - 1)))
        if last_n is not None:
            if not (out["prompt_logprobs"] or out["topk_prompt"]):
                raise BadRequest("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
            if prompt_len < 2:
                raise BadRequest("prompt_logprobs_last_n needs a prompt of at least 2 tokens")
            out["last_n"] = last_n
        if body.get("target_prompt_logprobs") is not None:
            out["target"] = _formats.target_ids(body["target_prompt_logprobs"], prompt_len, vocab, MAX_TOPK)
        return out

    @staticmethod
    def _sampling_params(sp: dict[str, Any], base: BaseModelSpec | HfModelSpec) -> dict[str, Any]:
        max_tokens = field_of(sp, "max_tokens", int, required=False, default=16)
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise BadRequest(f"sampling_params.max_tokens={max_tokens} must be within [1, {MAX_NEW_TOKENS}]")
        temperature = field_of(sp, "temperature", float, required=False, default=1.0)
        top_k = field_of(sp, "top_k", int, required=False, default=-1)
        top_p = field_of(sp, "top_p", float, required=False, default=1.0)
        if temperature < 0:
            raise BadRequest(f"sampling_params.temperature={temperature} must be a finite number >= 0")
        if not (0 < top_p <= 1):
            raise BadRequest(f"sampling_params.top_p={top_p} must be within (0, 1]")
        if top_k == 0 or top_k < -1:
            raise BadRequest(f"sampling_params.top_k={top_k} must be -1 (no limit) or >= 1")
        stop_tokens, stop_strings = _stops(sp.get("stop"), base)
        seed = field_of(sp, "seed", int, required=False, bounds=SEED_BOUNDS)
        return {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "stop_tokens": stop_tokens, "stop_strings": stop_strings, "seed": seed}

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
        if fut.error is not None:
            reply = _json({"error": fut.error, "category": fut.category, "request_id": fut.request_id})
        elif fut.proto is not None:
            if PROTO not in req.header("accept"):
                raise BadRequest(f"the result of {fut.request_id} ({fut.kind}) is protobuf; send Accept: {PROTO}",
                                 status=406)
            reply = Reply(200, fut.proto, PROTO)
        else:
            reply = _json(fut.json)
        fut.timing.setdefault("answered", time.monotonic())
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
        from rota_tinker._worker.pool import MAX_TURN_S

        xdg = os.environ.get("XDG_RUNTIME_DIR")
        folder = tempfile.mkdtemp(prefix="rota-tinker-", dir=xdg if xdg and os.path.isdir(xdg) else None)
        self._orchestrator.callback(shutil.rmtree, folder, True)
        # a busy LoRA pool would hold the device forever: past MAX_TURN_S, with others waiting, it is asked to yield
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
