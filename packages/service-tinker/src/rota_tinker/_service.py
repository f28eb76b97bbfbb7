"""The HTTP service: the subset of the Tinker API that the tinker SDK (0.38) uses to train and sample.

Who calls it: the official ``tinker`` SDK (``TINKER_BASE_URL=http://HOST:PORT``,
``TINKER_API_KEY=tml-...``), started by ``rota tinker serve`` or, in tests, by
:class:`TinkerService` directly. Built on the standard library's threading HTTP server:
every request is small (work runs in the workers), and ``retrieve_future`` long-polls in
its own thread.

Served routes (all under ``/api/v1``): ``healthz``, ``client/config``,
``client/dynamic_config``, ``create_session``, ``session_heartbeat``,
``sessions/{id}/finish``, ``telemetry``,
``get_server_capabilities``, ``create_model``, ``get_info``, ``forward_backward``
(protobuf), ``optim_step``, ``save_weights_for_sampler``, ``create_sampling_session``,
``samplers/{id}``, ``asample``, ``retrieve_future``.

Rules enforced here:

* ``X-API-Key`` maps to a tenant (401 when missing or unknown); sessions, models,
  sampling sessions, sampler weights and futures belong to the tenant that created them
  (403 to any other tenant).
* Bodies are checked field by field (400 naming the field), content types too (415),
  unknown ids are 404, unsupported features are 400 saying what is supported.
* Work units go to the tenant's trainer or sampler worker (:mod:`rota_tinker._worker`)
  and come back as futures; a failed unit (or a dead worker) fails its future with an
  error the SDK raises as ``RequestFailedError``.
* LoRA models (and samplers of LoRA weights or of a bare base) attach to the one
  resident base of their (device, base) held by a base-holder process
  (:mod:`rota_tinker._base`), started on first use and stopped after every tenant
  worker (the producer of shared memory outlives its consumers).
* ``retrieve_future`` holds the request until the result is ready or ``long_poll_s``
  passes (the SDK re-polls at once after ``try_again``, without sleeping); every
  request is served by its own thread, so long polls never hold up heartbeats.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import math
import re
import secrets
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rota_tinker import _wire
from rota_tinker._config import BaseModelSpec, ServiceConfig, Tenant
from rota_tinker._wire import BadRequest, field_of
from rota_tinker._worker import WorkerSpec
from rota_tinker._workers import Future, WorkerHandle, close_all, unit_breakdown

log = logging.getLogger(__name__)

PROTO = "application/x-protobuf"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_PATH = re.compile(r"^tinker://([^/]+)/sampler_weights/([^/]+)$")
_FINISH = re.compile(r"^/api/v1/sessions/([^/]+)/finish$")
MAX_SAMPLES = 64
MAX_NEW_TOKENS = 1024

# The flags this server answers /client/config with: API keys only (no JWT exchange),
# the plain httpx transport, uncompressed protobuf forward_backward bodies.
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
class _Model:
    model_id: str
    tenant: str
    base: BaseModelSpec
    lora: dict[str, Any] | None


@dataclass
class _Weights:
    path: str
    tenant: str
    base: BaseModelSpec
    file: str
    lora: bool  # adapter weights (they go on the shared base), or a full model


@dataclass
class _SamplingSession:
    session_id: str
    tenant: str
    base: BaseModelSpec
    key: str  # weights file, or "base:NAME"
    model_path: str | None
    shareable: bool  # adapter weights or the bare base: sampled on the shared base


class _State:
    """Everything the service knows; guarded by one lock (requests are short)."""

    def __init__(self, config: ServiceConfig, endpoint: str | None) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.sessions: dict[str, str] = {}  # session_id -> tenant
        self.finished: set[str] = set()  # sessions the client finished (heartbeats then get 410)
        self.models: dict[str, _Model] = {}
        self.weights: dict[str, _Weights] = {}  # tinker:// path -> weights
        self.sampling: dict[str, _SamplingSession] = {}
        self.futures: dict[str, Future] = {}
        self._last_prune = 0.0
        self.forgotten_futures = 0  # finished futures dropped after future_ttl_s
        self.counter = itertools.count(1)
        self.workers: dict[tuple[str, str], WorkerHandle] = {}
        for t in config.tenants:
            for role in ("trainer", "sampler"):
                spec = WorkerSpec(tenant=t.name, role=role, group=config.group, endpoint=endpoint,
                                  device=config.device, data_dir=config.data_dir, torch_threads=config.torch_threads,
                                  units_per_turn=config.units_per_turn, release_cached=config.release_cached)
                self.workers[(t.name, role)] = WorkerHandle(spec, config.worker_start_timeout_s)
        self.holders: dict[str, WorkerHandle] = {}  # base name -> its holder on config.device

    def holder(self, base: BaseModelSpec) -> WorkerHandle:
        """The base-holder process of ``base`` on the service's device (made on first use, started by ``ensure``)."""
        with self.lock:
            handle = self.holders.get(base.name)
            if handle is None:
                spec = WorkerSpec(tenant=f"{base.name}@{self.config.device}", role="base", group=self.config.group,
                                  endpoint=None, device=self.config.device, data_dir=self.config.data_dir,
                                  torch_threads=self.config.torch_threads, base=base)
                handle = self.holders[base.name] = WorkerHandle(spec, self.config.worker_start_timeout_s)
        return handle

    def shared_base(self, base: BaseModelSpec, shareable: bool) -> str | None:
        """The address workers fetch ``base`` from, or None (sharing is off, or a full model needs its own copy).

        :raises RuntimeError: the holder could not start (the caller fails its future with it).
        """
        if not (shareable and self.config.share_lora_base):
            return None
        return str(self.holder(base).ensure()["address"])

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{next(self.counter)}-{secrets.token_hex(4)}"

    def future(self, tenant: str, kind: str) -> Future:
        fut = Future(request_id=self.new_id("req"), tenant=tenant, kind=kind)
        with self.lock:
            self._forget_old_futures()
            self.futures[fut.request_id] = fut
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
            self.forgotten_futures += 1


def _start_quietly(handle: WorkerHandle) -> None:
    """Start a worker ahead of its first unit; a failure is kept by the handle and fails that unit instead."""
    with contextlib.suppress(RuntimeError):
        handle.ensure()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # TCP_NODELAY: a response is headers then body, two sends; with Nagle the body waits for the
    # client's delayed ACK of the headers (about 40 ms on Linux) on every answer of a held long poll.
    disable_nagle_algorithm = True
    server: _Server

    # ------------------------------------------------------------ plumbing

    def log_message(self, format: str, *args: Any) -> None:  # route access logs to logging
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, obj: Any, status: int = 200) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json")

    def _error(self, status: int, message: str) -> None:
        log.info("%s %s -> %d: %s", self.command, self.path, status, message)
        self._json({"detail": message, "status": status}, status)

    def _body(self) -> bytes:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            raise BadRequest("chunked bodies are not supported; send Content-Length", status=411)
        if length is None:
            return b""
        try:
            n = int(length)
        except ValueError as e:
            raise BadRequest(f"Content-Length {length!r} is not an integer") from e
        if n < 0 or n > self.server.state.config.max_body_bytes:
            raise BadRequest(f"body of {n} bytes is over the limit of {self.server.state.config.max_body_bytes}",
                             status=413)
        return self.rfile.read(n)

    def _json_body(self, body: bytes) -> dict[str, Any]:
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise BadRequest(f"Content-Type {ctype or '(none)'!r} is not accepted here; send application/json",
                             status=415)
        try:
            obj = json.loads(_wire.decompress(body, self.headers.get("Content-Encoding", "")) or b"{}")
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"body is not valid JSON ({e})") from e
        if not isinstance(obj, dict):
            raise BadRequest(f"body must be a JSON object, got {type(obj).__name__}")
        return obj

    def _tenant(self) -> Tenant:
        key = self.headers.get("X-API-Key")
        if not key:
            raise BadRequest("X-API-Key header is missing; set TINKER_API_KEY to your tml-... key", status=401)
        tenant = self.server.state.config.tenant_for_key(key)
        if tenant is None:
            raise BadRequest(f"API key {key[:8]}... is not known to this service; use the key you were given",
                             status=401)
        return tenant

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def _dispatch(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        try:
            body = self._body()
            if path == "/api/v1/healthz" and method == "GET":
                self._json({"status": "ok"})
                return
            route = ROUTES.get(path)
            arg = None
            if route is None and path.startswith("/api/v1/samplers/"):
                route, arg = ("GET", _Handler._get_sampler), path[len("/api/v1/samplers/"):]
            finish = _FINISH.match(path)
            if route is None and finish:
                route, arg = ("POST", _Handler._finish_session), finish.group(1)
            if route is None:
                raise BadRequest(f"no route {path!r}; this service serves the tinker SDK's /api/v1 training and "
                                 "sampling routes (see rota_tinker's README)", status=404)
            want, fn = route
            if method != want:
                raise BadRequest(f"{path} takes {want}, not {method}", status=405)
            tenant = self._tenant()
            if arg is not None:
                fn(self, tenant, arg)
            elif want == "GET":
                fn(self, tenant)
            elif fn is _Handler._forward_backward:
                fn(self, tenant, body)
            else:
                fn(self, tenant, self._json_body(body))
        except BadRequest as e:
            self._error(e.status, str(e))
        except (BrokenPipeError, ConnectionResetError):
            log.debug("client went away during %s", path)
        except Exception as e:  # a bug: answer 500 with what happened rather than dropping the connection
            log.exception("%s %s failed", method, path)
            self._error(500, f"internal error: {type(e).__name__}: {e}")

    # ------------------------------------------------------------ ownership

    def _owned(self, table: dict[str, Any], key: str, what: str, tenant: Tenant) -> Any:
        with self.server.state.lock:
            item = table.get(key)
        if item is None:
            kept = (f" (results are kept {self.server.state.config.future_ttl_s:g} s after they finish)"
                    if what == "request" else "")
            raise BadRequest(f"{what} {key!r} does not exist{kept}; use an id this service returned", status=404)
        owner = item if isinstance(item, str) else item.tenant
        if owner != tenant.name:
            raise BadRequest(f"{what} {key!r} belongs to another tenant; use your own", status=403)
        return item

    def _session(self, tenant: Tenant, body: dict[str, Any]) -> str:
        sid = field_of(body, "session_id", str)
        self._owned(self.server.state.sessions, sid, "session", tenant)
        return sid

    def _model(self, tenant: Tenant, model_id: str) -> _Model:
        return self._owned(self.server.state.models, model_id, "model", tenant)

    def _future_reply(self, fut: Future, model_id: str | None = None, **extra: Any) -> None:
        self._json({"request_id": fut.request_id, "model_id": model_id, **extra})

    # ------------------------------------------------------------ session routes

    def _client_config(self, tenant: Tenant, body: dict[str, Any]) -> None:
        self._json(CLIENT_CONFIG)

    def _dynamic_config(self, tenant: Tenant, body: dict[str, Any]) -> None:
        self._json({"refresh_interval_sec": 300, "sample_cancel_enabled": False})

    def _create_session(self, tenant: Tenant, body: dict[str, Any]) -> None:
        field_of(body, "sdk_version", str, required=False)
        tags = field_of(body, "tags", list, required=False, default=[])
        if not all(isinstance(t, str) for t in tags):
            raise BadRequest("field 'tags' must be a list of strings")
        state = self.server.state
        sid = state.new_id(f"{tenant.name}-session")
        with state.lock:
            state.sessions[sid] = tenant.name
        log.info("tenant %s: session %s", tenant.name, sid)
        self._json({"type": "create_session", "session_id": sid})

    def _heartbeat(self, tenant: Tenant, body: dict[str, Any]) -> None:
        sid = self._session(tenant, body)
        if sid in self.server.state.finished:  # the SDK stops its heartbeat loop on 410
            raise BadRequest(f"session {sid!r} was finished; create a new session", status=410)
        self._json({"type": "session_heartbeat"})

    def _finish_session(self, tenant: Tenant, session_id: str) -> None:
        """``ServiceClient.close()``: the session ends (its models stay; heartbeats get 410)."""
        self._owned(self.server.state.sessions, session_id, "session", tenant)
        with self.server.state.lock:
            self.server.state.finished.add(session_id)
        log.info("tenant %s: session %s finished", tenant.name, session_id)
        self._json({})

    def _telemetry(self, tenant: Tenant, body: dict[str, Any]) -> None:
        self._json({"status": "accepted"})

    def _capabilities(self, tenant: Tenant) -> None:
        models = [{"model_name": m.name, "max_context_length": m.max_len, "trainable": True, "sampleable": True}
                  for m in self.server.state.config.base_models.values()]
        self._json({"supported_models": models})

    # ------------------------------------------------------------ training routes

    def _base(self, name: Any) -> BaseModelSpec:
        spec = self.server.state.config.base_models.get(name) if isinstance(name, str) else None
        if spec is None:
            raise BadRequest(f"base_model {name!r} is not served here; choose one of "
                             f"{sorted(self.server.state.config.base_models)}", status=404)
        return spec

    def _create_model(self, tenant: Tenant, body: dict[str, Any]) -> None:
        self._session(tenant, body)
        field_of(body, "model_seq_id", int)
        base = self._base(field_of(body, "base_model", str))
        opt = field_of(body, "optimizer_config", dict, required=False, default={"type": "adamw"})
        if opt.get("type", "adamw") != "adamw":
            raise BadRequest(f"optimizer_config type {opt.get('type')!r} is not supported; use adamw (the default)")
        lora_cfg = field_of(body, "lora_config", dict, required=False)
        lora = None
        if lora_cfg is not None:
            rank = field_of(lora_cfg, "rank", int)
            if not 1 <= rank <= min(256, base.dim):
                raise BadRequest(f"lora_config.rank={rank} must be within [1, {min(256, base.dim)}] for "
                                 f"base model {base.name!r}")
            seed = field_of(lora_cfg, "seed", int, required=False)
            targets = {g: field_of(lora_cfg, f"train_{g}", bool, required=False, default=True)
                       for g in ("mlp", "attn", "unembed")}
            if not any(targets.values()):
                raise BadRequest("lora_config trains nothing; set at least one of train_mlp, train_attn, "
                                 "train_unembed")
            lora = {"rank": rank, "seed": secrets.randbelow(2**31) if seed is None else seed, "targets": targets}
        state = self.server.state
        model_id = state.new_id(f"{tenant.name}-model")
        fut = state.future(tenant.name, "CreateModel")
        trainer = state.workers[(tenant.name, "trainer")]

        def done(result: Any) -> None:
            with state.lock:
                state.models[model_id] = _Model(model_id, tenant.name, base, lora)
            fut.succeed(json={"model_id": model_id, "type": "create_model"})

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
                trainer.submit(fut, "create", {"model_id": model_id, "base": base, "lora": lora,
                                               "shared_base": shared}, done, restart=True)
            except Exception as e:  # never leave the future pending
                log.exception("create_model %s failed to start", model_id)
                fut.fail(f"create_model could not start: {type(e).__name__}: {e}", "server")

        threading.Thread(target=start, name=f"rota-tinker-create-{model_id}", daemon=True).start()
        log.info("tenant %s: create_model %s (%s, %s)", tenant.name, model_id, base.name,
                 f"lora rank {lora['rank']}" if lora else "full-parameter")
        self._future_reply(fut, model_id)

    def _get_info(self, tenant: Tenant, body: dict[str, Any]) -> None:
        m = self._model(tenant, field_of(body, "model_id", str))
        self._json({"type": "get_info", "model_id": m.model_id, "model_name": m.base.name,
                    "is_lora": m.lora is not None, "lora_rank": m.lora["rank"] if m.lora else None,
                    "model_data": {"arch": "rota-tinylm", "model_name": m.base.name, "tokenizer_id": None}})

    def _forward_backward(self, tenant: Tenant, body: bytes) -> None:
        ctype = self.headers.get("Content-Type", "").split(";")[0].strip().lower()
        if ctype != PROTO:
            raise BadRequest(f"forward_backward takes Content-Type {PROTO} (the tinker SDK's "
                             f"ForwardBackwardRequest protobuf), not {ctype or '(none)'!r}", status=415)
        req = _wire.parse_forward_backward(_wire.decompress(body, self.headers.get("Content-Encoding", "")))
        m = self._model(tenant, req.model_id)
        data = []
        for i, d in enumerate(req.data):
            targets = d.inputs["target_tokens"]
            for name, arr in (("model_input", d.tokens), ("target_tokens", targets)):
                if arr.min() < 0 or arr.max() >= m.base.vocab:
                    raise BadRequest(f"data[{i}].{name} has token ids outside [0, {m.base.vocab}) of base model "
                                     f"{m.base.name!r}")
            if d.tokens.size > m.base.max_len:
                raise BadRequest(f"data[{i}] has {d.tokens.size} tokens; base model {m.base.name!r} takes at most "
                                 f"{m.base.max_len}")
            data.append((d.tokens, d.inputs))
        fut = self.server.state.future(tenant.name, "ForwardBackward")

        def done(result: Any) -> None:
            fut.succeed(proto=_wire.forward_backward_output(result["logprobs"], result["metrics"]))

        self.server.state.workers[(tenant.name, "trainer")].submit(
            fut, "forward_backward",
            {"model_id": m.model_id, "loss_fn": req.loss_fn, "forward_only": req.forward_only, "data": data}, done)
        self._future_reply(fut, m.model_id)

    def _optim_step(self, tenant: Tenant, body: dict[str, Any]) -> None:
        m = self._model(tenant, field_of(body, "model_id", str))
        if body.get("optimizer_params") is not None:
            raise BadRequest("optimizer_params (non-Adam optimizers) are not supported; send AdamParams")
        p = field_of(body, "adam_params", dict)
        adam = {k: field_of(p, k, float, required=False, default=d) for k, d in
                (("learning_rate", 1e-4), ("beta1", 0.9), ("beta2", 0.95), ("eps", 1e-12), ("weight_decay", 0.0),
                 ("grad_clip_norm", 0.0))}
        bad = [k for k, v in adam.items() if not math.isfinite(v)]
        if bad:
            raise BadRequest(f"adam_params {bad} must be finite numbers")
        if adam["learning_rate"] < 0 or adam["eps"] <= 0 or adam["weight_decay"] < 0 or adam["grad_clip_norm"] < 0:
            raise BadRequest(f"adam_params {adam} out of range: learning_rate, weight_decay and grad_clip_norm must "
                             "be >= 0 and eps > 0")
        if not (0 <= adam["beta1"] < 1 and 0 <= adam["beta2"] < 1):
            raise BadRequest(f"adam_params beta1={adam['beta1']}, beta2={adam['beta2']} must be within [0, 1)")
        fut = self.server.state.future(tenant.name, "OptimStep")
        self.server.state.workers[(tenant.name, "trainer")].submit(
            fut, "optim_step", {"model_id": m.model_id, "adam": adam},
            lambda result: fut.succeed(json={"metrics": result["metrics"]}))
        self._future_reply(fut, m.model_id)

    def _save_for_sampler(self, tenant: Tenant, body: dict[str, Any]) -> None:
        state = self.server.state
        m = self._model(tenant, field_of(body, "model_id", str))
        name = field_of(body, "path", str, required=False)
        if name is None:
            field_of(body, "sampling_session_seq_id", int)
            name = f"ephemeral-{secrets.token_hex(6)}"
        elif not _NAME.match(name):
            raise BadRequest(f"path {name!r} is not a valid checkpoint name: use 1-64 letters, digits, '.', '_', '-'")
        tinker_path = f"tinker://{m.model_id}/sampler_weights/{name}"
        ephemeral = body.get("path") is None
        fut = state.future(tenant.name, "SaveWeightsForSampler")

        def done(result: Any) -> None:
            with state.lock:
                state.weights[tinker_path] = _Weights(tinker_path, tenant.name, m.base, result["file"],
                                                      m.lora is not None)
            if ephemeral:
                sid = self._new_sampling_session(tenant, m.base, result["file"], tinker_path, m.lora is not None)
                fut.succeed(json={"type": "save_weights_for_sampler", "sampling_session_id": sid})
            else:
                fut.succeed(json={"type": "save_weights_for_sampler", "path": tinker_path})

        state.workers[(tenant.name, "trainer")].submit(
            fut, "save_for_sampler", {"model_id": m.model_id, "name": name}, done)
        self._future_reply(fut, m.model_id)

    # ------------------------------------------------------------ sampling routes

    def _new_sampling_session(self, tenant: Tenant, base: BaseModelSpec, key: str, model_path: str | None,
                              shareable: bool) -> str:
        state = self.server.state
        sid = state.new_id(f"{tenant.name}-sampler")
        with state.lock:
            state.sampling[sid] = _SamplingSession(sid, tenant.name, base, key, model_path, shareable)
        return sid

    def _weights_for(self, tenant: Tenant, model_path: str) -> _Weights:
        if not _PATH.match(model_path):
            raise BadRequest(f"model_path {model_path!r} is not a sampler weights path; use the path "
                             "save_weights_for_sampler returned (tinker://MODEL/sampler_weights/NAME)")
        return self._owned(self.server.state.weights, model_path, "sampler weights", tenant)

    def _create_sampling_session(self, tenant: Tenant, body: dict[str, Any]) -> None:
        self._session(tenant, body)
        field_of(body, "sampling_session_seq_id", int)
        model_path = field_of(body, "model_path", str, required=False)
        base_name = field_of(body, "base_model", str, required=False)
        if model_path is not None:
            w = self._weights_for(tenant, model_path)
            if base_name is not None and base_name != w.base.name:
                raise BadRequest(f"base_model {base_name!r} differs from {w.base.name!r} of {model_path!r}; "
                                 "leave base_model out")
            sid = self._new_sampling_session(tenant, w.base, w.file, model_path, w.lora)
        elif base_name is not None:
            base = self._base(base_name)
            sid = self._new_sampling_session(tenant, base, f"base:{base.name}", None, True)
        else:
            raise BadRequest("give model_path (weights saved for the sampler) or base_model")
        self._json({"type": "create_sampling_session", "sampling_session_id": sid})

    def _get_sampler(self, tenant: Tenant, sampler_id: str) -> None:
        s = self._owned(self.server.state.sampling, sampler_id, "sampler", tenant)
        self._json({"sampler_id": s.session_id, "base_model": s.base.name, "model_path": s.model_path})

    def _asample(self, tenant: Tenant, body: dict[str, Any]) -> None:
        state = self.server.state
        sid = field_of(body, "sampling_session_id", str, required=False)
        if sid is not None:
            field_of(body, "seq_id", int)
            s = self._owned(state.sampling, sid, "sampling session", tenant)
            base, key, shareable = s.base, s.key, s.shareable
        elif body.get("model_path") is not None:
            w = self._weights_for(tenant, field_of(body, "model_path", str))
            base, key, shareable = w.base, w.file, w.lora
        else:
            base = self._base(field_of(body, "base_model", str))
            key, shareable = f"base:{base.name}", True
        for flag in ("prompt_logprobs", "record_stability_info"):
            if field_of(body, flag, bool, required=False, default=False):
                raise BadRequest(f"{flag}=true is not supported by this service; leave it false")
        for count in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if field_of(body, count, int, required=False, default=0):
                raise BadRequest(f"{count} is not supported by this service; leave it 0")
        if body.get("target_prompt_logprobs") is not None:
            raise BadRequest("target_prompt_logprobs is not supported by this service")
        num = field_of(body, "num_samples", int, required=False, default=1)
        if not 1 <= num <= MAX_SAMPLES:
            raise BadRequest(f"num_samples={num} must be within [1, {MAX_SAMPLES}]")
        prompt = _wire.prompt_tokens(body.get("prompt"))
        if prompt.min() < 0 or prompt.max() >= base.vocab:
            raise BadRequest(f"prompt has token ids outside [0, {base.vocab}) of base model {base.name!r}")
        if prompt.size >= base.max_len:
            raise BadRequest(f"prompt has {prompt.size} tokens; base model {base.name!r} takes fewer than "
                             f"{base.max_len}")
        sp = field_of(body, "sampling_params", dict)
        params = self._sampling_params(sp)
        seed = params.pop("seed")
        seed = secrets.randbelow(2**31) if seed is None else seed
        fut = state.future(tenant.name, "Sample")
        seq_ids = [f"{fut.request_id}:{i}" for i in range(num)]
        try:
            shared = state.shared_base(base, shareable)
        except RuntimeError as e:
            fut.fail(f"the shared base {base.name!r} is not available: {e}", "server")
            self._future_reply(fut, None, sample_sequence_ids=seq_ids)
            return
        state.workers[(tenant.name, "sampler")].submit(
            fut, "sample", {"key": key, "base": base, "prompt": prompt, "params": params, "num_samples": num,
                            "seed": seed, "shared_base": shared},
            lambda result: fut.succeed(proto=_wire.sample_response(result)), restart=True)
        self._future_reply(fut, None, sample_sequence_ids=seq_ids)

    @staticmethod
    def _sampling_params(sp: dict[str, Any]) -> dict[str, Any]:
        max_tokens = field_of(sp, "max_tokens", int, required=False, default=16)
        if not 1 <= max_tokens <= MAX_NEW_TOKENS:
            raise BadRequest(f"sampling_params.max_tokens={max_tokens} must be within [1, {MAX_NEW_TOKENS}]")
        temperature = field_of(sp, "temperature", float, required=False, default=1.0)
        top_k = field_of(sp, "top_k", int, required=False, default=-1)
        top_p = field_of(sp, "top_p", float, required=False, default=1.0)
        if not (math.isfinite(temperature) and temperature >= 0):
            raise BadRequest(f"sampling_params.temperature={temperature} must be a finite number >= 0")
        if not (0 < top_p <= 1):
            raise BadRequest(f"sampling_params.top_p={top_p} must be within (0, 1]")
        if top_k == 0 or top_k < -1:
            raise BadRequest(f"sampling_params.top_k={top_k} must be -1 (no limit) or >= 1")
        stop = sp.get("stop")
        if isinstance(stop, str) or (isinstance(stop, list) and any(isinstance(s, str) for s in stop)):
            raise BadRequest("sampling_params.stop as strings needs a tokenizer, which this service does not have; "
                             "give stop token ids (a list of integers)")
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, int) for s in stop)):
            raise BadRequest("sampling_params.stop must be a list of token ids")
        seed = field_of(sp, "seed", int, required=False)
        return {"max_tokens": max_tokens, "temperature": temperature, "top_k": top_k, "top_p": top_p,
                "stop_tokens": stop or [], "seed": seed}

    # ------------------------------------------------------------ futures

    def _retrieve_future(self, tenant: Tenant, body: dict[str, Any]) -> None:
        rid = field_of(body, "request_id", str)
        field_of(body, "allow_metadata_only", bool, required=False)
        fut: Future = self._owned(self.server.state.futures, rid, "request", tenant)
        if not fut.done.wait(self.server.state.config.long_poll_s):
            self._json({"type": "try_again", "request_id": rid, "queue_state": "active",
                        "queue_state_reason": "running or waiting for its turn on the GPU"})
            return
        if fut.error is not None:
            self._json({"error": fut.error, "category": fut.category, "request_id": rid})
        elif fut.proto is not None:
            accept = self.headers.get("Accept", "")
            if PROTO not in accept:
                raise BadRequest(f"the result of {rid} ({fut.kind}) is protobuf; send Accept: {PROTO}", status=406)
            self._send(200, fut.proto, PROTO)
        else:
            self._json(fut.json)
        fut.timing.setdefault("answered", time.monotonic())


ROUTES: dict[str, tuple[str, Any]] = {
    "/api/v1/client/config": ("POST", _Handler._client_config),
    "/api/v1/client/dynamic_config": ("POST", _Handler._dynamic_config),
    "/api/v1/create_session": ("POST", _Handler._create_session),
    "/api/v1/session_heartbeat": ("POST", _Handler._heartbeat),
    "/api/v1/telemetry": ("POST", _Handler._telemetry),
    "/api/v1/get_server_capabilities": ("GET", _Handler._capabilities),
    "/api/v1/create_model": ("POST", _Handler._create_model),
    "/api/v1/get_info": ("POST", _Handler._get_info),
    "/api/v1/forward_backward": ("POST", _Handler._forward_backward),
    "/api/v1/optim_step": ("POST", _Handler._optim_step),
    "/api/v1/save_weights_for_sampler": ("POST", _Handler._save_for_sampler),
    "/api/v1/create_sampling_session": ("POST", _Handler._create_sampling_session),
    "/api/v1/asample": ("POST", _Handler._asample),
    "/api/v1/retrieve_future": ("POST", _Handler._retrieve_future),
}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128  # listen backlog: many SDK clients connect at once (the default 5 drops SYNs)
    state: _State


class TinkerService:
    """The service: HTTP front end plus one trainer and one sampler worker per tenant.

    ``with TinkerService(config).running() as url: ...`` serves on ``config``'s address in a
    background thread; workers start on a tenant's first work unit and stop with the service.
    """

    endpoint: str | None  # the orchestrator the workers use (None: ROTA_ORCHESTRATOR or the embedded one)

    def __init__(self, config: ServiceConfig, host: str = "127.0.0.1", port: int = 0) -> None:
        self._orchestrator = contextlib.ExitStack()
        try:
            # residency-aware switching needs an orchestrator that knows the device size: the service's own
            self.endpoint = self._own_orchestrator(config) if config.capacity_bytes else config.endpoint
            self._httpd = _Server((host, port), _Handler)
        except BaseException:
            self._orchestrator.close()
            raise
        self.config = config
        self.state = _State(config, self.endpoint)
        self._httpd.state = self.state
        self._thread: threading.Thread | None = None

    def _own_orchestrator(self, config: ServiceConfig) -> str:
        """Serve a private orchestrator (loopback, in this process) with ``config.capacity_bytes``; its endpoint."""
        from rota._engine import OrchestratorConfig
        from rota._inproc import running_orchestrator

        endpoint, _engine = self._orchestrator.enter_context(
            running_orchestrator(OrchestratorConfig(capacity_bytes=config.capacity_bytes)))
        log.info("own orchestrator at %s, capacity %.1f GiB", endpoint, config.capacity_bytes / 2**30)
        return endpoint

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> str:
        """Serve in a background thread; returns the base URL."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="rota-tinker-http", daemon=True)
        self._thread.start()
        log.info("tinker service on %s for tenants %s (device %s, group %s)", self.url,
                 [t.name for t in self.config.tenants], self.config.device, self.config.group)
        return self.url

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`stop` (or KeyboardInterrupt)."""
        self._httpd.serve_forever()

    def worker_pid(self, tenant: str, role: str) -> int | None:
        """The pid of a tenant's trainer or sampler worker (None before its first work unit)."""
        return self.state.workers[(tenant, role)].pid

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
            handles = [*self.state.workers.values(), *self.state.holders.values()]
        return {h.name: dict(h.start_s) for h in handles if h.start_s}

    def unit_timings(self) -> list[dict[str, Any]]:
        """Every finished work unit still kept (``future_ttl_s``): tenant, kind, request id, stamps and breakdown.

        For benchmarks: see :func:`rota_tinker._workers.unit_breakdown` for what each part means.
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
        """
        self._httpd.shutdown()
        self._httpd.server_close()
        killed = close_all(self.state.workers.values(), self.config.stop_timeout_s)
        with self.state.lock:
            holders = list(self.state.holders.values())
        killed += close_all(holders, self.config.stop_timeout_s)
        if killed:
            log.warning("stopped; killed %s (they did not exit within %.0f s)", killed, self.config.stop_timeout_s)
        if self._thread is not None:
            self._thread.join(10)
        self._orchestrator.close()
        return killed

    def __enter__(self) -> TinkerService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
