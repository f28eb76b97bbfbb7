"""Serving an inference server as a rota tenant: endpoint client, turn gate, proxy, supervisor.

Shared by :mod:`rota_vllm` and :mod:`rota_sglang` (the HTTP protocol itself lives in
:mod:`rota_agent.backends.app_endpoint`, so the node agent and these adapters speak it
through one piece of code). Who calls it: ``rota vllm serve`` / ``rota sglang serve``
through :func:`serve_app`, and tests.

The picture::

    client ──HTTP──► TurnProxy (--listen) ──HTTP──► engine (127.0.0.1:<internal port>)
                        │ TurnGate: acquire on demand,        ▲
                        │ release when idle                   │ /sleep, /wake_up … (EndpointClient)
                        └── Gpu (rota session) ── rota_park / rota_restore hooks (EndpointParker)

* A request that needs the GPU enters the :class:`TurnGate`: if this tenant does not
  hold its group, the gate acquires it (blocking the request, never failing it); the
  grant restores the engine (``wake_up``) if it was parked. When no request has been
  in flight for ``idle_release_s`` the gate releases the turn; with nobody waiting
  the orchestrator parks nothing (lazy parking), so the next request pays nothing.
  When the policy asks the holder to yield (``gpu.should_yield``) new requests wait
  while the ones in flight finish, the turn is released, and they queue again.
* The orchestrator (through the rota session, or through the node agent's
  WorkloadChannel when one is registered) parks the engine between turns:
  :class:`EndpointParker` maps the :class:`rota.ParkPlan` to the engine's own sleep
  API (vLLM: OFFLOAD → ``/sleep?level=1``, DISCARD → ``level=2``; SGLang: release
  with the plan's tags).
* Paths in ``free_paths`` (health, metrics, model list) are forwarded without a
  turn; the engine's own sleep/wake routes are refused (409) so that only rota
  moves the engine's memory.
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import logging
import os
import signal
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rota import Gpu, ParkMode, ParkPlan, ParkResult, hookimpl
from rota.errors import InvalidArgument, PermanentError, RotaError
from rota.rpc import free_port
from rota.wire import snapshot_agent_pb2 as pb
from rota_agent.backends.app_endpoint import AppEndpointBackend, EndpointPlan

log = logging.getLogger(__name__)

VLLM, SGLANG = "vllm", "sglang"
_APPS = {VLLM: pb.APP_VLLM, SGLANG: pb.APP_SGLANG}
#: Tags each engine understands (vLLM ``wake_up(tags=)``, SGLang memory-saver tags).
APP_TAGS: dict[str, tuple[str, ...]] = {VLLM: ("weights", "kv_cache"), SGLANG: ("weights", "kv_cache", "cuda_graph")}
#: Engine routes that move memory: only rota may call them, so the proxy refuses them.
CONTROL_PATHS = frozenset({"/sleep", "/wake_up", "/release_kv_cache_memory", "/release_memory_occupation",
                           "/resume_memory_occupation"})
#: Routes that never need the GPU: forwarded without taking a turn.
FREE_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/v1/models", "/is_sleeping",
                        "/get_model_info", "/get_server_info", "/health_generate_skip"})
_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                  "transfer-encoding", "upgrade", "content-length", "host"})


class ServingError(PermanentError):
    """The engine could not be started, reached, or put to sleep/woken as asked."""


def check_base_url(url: str, what: str = "endpoint") -> str:
    """``http(s)://HOST:PORT`` with no path beyond ``/``; returned without a trailing slash."""
    u = urllib.parse.urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment or u.path not in ("", "/"):
        raise InvalidArgument(f"{what} {url!r} is not a base URL like http://127.0.0.1:8000 (scheme, host, "
                              "port; no path or query)")
    return url.rstrip("/")


def check_listen(value: str, what: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` → (host, port), with a message naming ``what`` on bad input."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"{what}={value!r} is not HOST:PORT (e.g. 0.0.0.0:8000; port 0 picks a free one)")
    return host.strip("[]"), int(port)


def check_tags(app: str, tags: Sequence[str], what: str = "tags") -> tuple[str, ...]:
    """Each tag must be one ``app`` knows; the message lists the ones it does."""
    known = APP_TAGS[app]
    for t in tags:
        if t not in known:
            raise InvalidArgument(f"{what}: {t!r} is not a {app} memory tag; use one of {', '.join(known)}")
    return tuple(tags)


# --------------------------------------------------------------------- endpoint client


@dataclass
class EndpointClient:
    """The sleep/wake HTTP API of one engine (vLLM or SGLang), through the agent's code.

    :param app: ``"vllm"`` or ``"sglang"``.
    :param base_url: the engine's own address (not the proxy's).
    :param timeout_s: deadline of one HTTP call.
    """

    app: str
    base_url: str
    timeout_s: float = 300.0
    _http: AppEndpointBackend = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.app not in _APPS:
            raise InvalidArgument(f"app {self.app!r} is not one of {', '.join(_APPS)}")
        if not self.timeout_s > 0:
            raise InvalidArgument(f"timeout_s={self.timeout_s!r} must be > 0 seconds")
        self.base_url = check_base_url(self.base_url, f"{self.app} endpoint")
        self._http = AppEndpointBackend(timeout_s=self.timeout_s)

    def call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """``method`` ``path`` on the engine; parsed JSON (or text); raises on non-2xx."""
        return self._http.call(method, self.base_url + path, body)

    def _plan(self, mode: ParkMode, tags: Sequence[str]) -> EndpointPlan:
        smode = pb.SUSPEND_MODE_DISCARD if mode == ParkMode.DISCARD else pb.SUSPEND_MODE_OFFLOAD
        return EndpointPlan(_APPS[self.app], (self.base_url,), smode, tuple(tags))

    def sleep(self, mode: ParkMode = ParkMode.OFFLOAD, tags: Sequence[str] = ()) -> None:
        """Park the engine (vLLM: level 1 for OFFLOAD, 2 for DISCARD; SGLang: release ``tags``)."""
        check_tags(self.app, tags)
        self._http.step(self._plan(mode, tags), self.base_url, sleep=True)

    def wake(self, tags: Sequence[str] = ()) -> None:
        """Bring back ``tags`` (all when empty)."""
        check_tags(self.app, tags)
        self._http.step(self._plan(ParkMode.OFFLOAD, tags), self.base_url, sleep=False)

    def is_sleeping(self) -> bool | None:
        """vLLM's ``GET /is_sleeping``; None for SGLang (it has no such route)."""
        if self.app != VLLM:
            return None
        got = self.call("GET", "/is_sleeping")
        if not isinstance(got, dict) or not isinstance(got.get("is_sleeping"), bool):
            raise ServingError(f"{self.base_url}/is_sleeping answered {got!r}; expected {{\"is_sleeping\": bool}}")
        return got["is_sleeping"]

    def wait_ready(self, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
        """Poll ``GET /health`` until 200, ``alive()`` turns false, or ``timeout_s`` passes."""
        deadline = time.monotonic() + timeout_s
        last = "no answer yet"
        while time.monotonic() < deadline:
            if not alive():
                raise ServingError(f"the {self.app} server exited before {self.base_url}/health answered "
                                   f"(last: {last}); see its log above")
            try:
                with contextlib.closing(_connect(self.base_url, 5.0)) as conn:
                    conn.request("GET", "/health")
                    resp = conn.getresponse()
                    resp.read()
                    if resp.status == 200:
                        return
                    last = f"HTTP {resp.status}"
            except OSError as exc:
                last = str(exc)
            time.sleep(0.2)
        raise ServingError(f"{self.base_url}/health did not answer 200 within {timeout_s:g} s (last: {last}); "
                           "raise --ready-timeout if the model is large")


def _connect(base_url: str, timeout: float) -> http.client.HTTPConnection:
    u = urllib.parse.urlsplit(base_url)
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80), timeout=timeout)


# ----------------------------------------------------------------------- park hooks


class EndpointParker:
    """rota_park / rota_restore of one tenant whose state is an engine behind HTTP.

    Registered on ``gpu.pm`` by :func:`track_endpoint`; answers only for its ``gpu``.
    ``mode`` forces a park mode (e.g. DISCARD in RL, where the trainer pushes fresh
    weights every step); else the plan's mode is used. ``dropped`` lists the tags the
    last park lost (their contents must be recomputed or pushed again).
    """

    def __init__(self, gpu: Gpu, client: EndpointClient, *, mode: ParkMode | None = None,
                 tags: Sequence[str] = (), footprint_bytes: int = 0) -> None:
        if footprint_bytes < 0:
            raise InvalidArgument(f"footprint_bytes={footprint_bytes} must be >= 0 (0 = unknown)")
        self.gpu, self.client, self.mode = gpu, client, mode
        self.footprint_bytes = footprint_bytes
        self.tags = check_tags(client.app, tags, "park tags")
        self.parked = False
        self.dropped: tuple[str, ...] = ()
        self.history: list[tuple[str, str, tuple[str, ...]]] = []  # (park|restore, mode, tags)

    def _mode(self, plan: ParkPlan) -> ParkMode:
        if self.mode is not None:
            return self.mode
        if plan.mode == ParkMode.DISCARD or "weights" in plan.discard:
            return ParkMode.DISCARD
        return ParkMode.OFFLOAD

    @hookimpl
    def rota_park(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu:
            return None
        t0 = time.perf_counter()
        mode = self._mode(plan)
        tags = tuple(t for t in sorted(plan.tags) if t in APP_TAGS[self.client.app]) if plan.tags else self.tags
        self.client.sleep(mode, tags)
        self.parked = True
        if self.client.app == VLLM:
            # level 1 offloads weights and drops the KV cache; level 2 drops both
            self.dropped = ("weights", "kv_cache") if mode == ParkMode.DISCARD else ("kv_cache",)
        else:
            self.dropped = ("kv_cache",) if not tags or "kv_cache" in tags else ()
        self.history.append(("park", mode.value, tags))
        log.info("%s %s parked (%s, tags=%s; dropped %s)", self.client.app, self.client.base_url, mode.value,
                 ",".join(tags) or "all", ",".join(self.dropped) or "nothing")
        return ParkResult(seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_restore(self, tenant: Gpu, plan: ParkPlan) -> ParkResult | None:
        if tenant is not self.gpu or not self.parked:
            return None
        t0 = time.perf_counter()
        self.client.wake(())
        self.parked = False
        self.history.append(("restore", "", ()))
        log.info("%s %s woken", self.client.app, self.client.base_url)
        return ParkResult(seconds=time.perf_counter() - t0)

    @hookimpl
    def rota_footprint(self, tenant: Gpu) -> dict[str, int] | None:
        """The engine's device bytes while awake: ``footprint_bytes``, or 1 when unknown.

        An awake engine always holds device memory, and the orchestrator parks only
        residents with a footprint, so "unknown" is reported as 1 byte (park it
        whenever another tenant needs the group). A parked engine reports 0.
        """
        if tenant is not self.gpu:
            return None
        return {"engine": 0 if self.parked else (self.footprint_bytes or 1)}


def wait_attached(gpu: Gpu, timeout_s: float = 30.0) -> None:
    """Block until the orchestrator lists ``gpu``'s tenant (its session is attached).

    The orchestrator parks a resident only over a live session; a request served
    before the session is attached could otherwise hold the GPU unparkable.
    """
    from rota.wire import rota_v1_pb2 as v1

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            reply = gpu.stub.Status(v1.StatusRequest(group_id=gpu.group), timeout=5)
            if any(t.job_id == gpu.tenant for g in reply.groups for t in g.tenants):
                return
        time.sleep(0.05)
    raise ServingError(f"the rota session of {gpu.tenant!r} (group {gpu.group!r}) did not attach to "
                       f"{gpu.endpoint} within {timeout_s:g} s; is the orchestrator reachable?",
                       job_id=gpu.tenant, group_id=gpu.group)


def track_endpoint(gpu: Gpu, client: EndpointClient, *, mode: ParkMode | None = None,
                   tags: Sequence[str] = (), footprint_bytes: int = 0) -> EndpointParker:
    """Register an :class:`EndpointParker` for ``client`` on ``gpu``'s plugin manager."""
    parker = EndpointParker(gpu, client, mode=mode, tags=tags, footprint_bytes=footprint_bytes)
    gpu.pm.register(parker, name=f"rota-endpoint-{gpu.tenant}-{id(parker):x}")
    return parker


# ------------------------------------------------------------------------ turn gate


class TurnGate:
    """Holds ``gpu``'s turn while requests are in flight; acquires on demand, releases when idle.

    Thread-safe. ``idle_release_s`` = 0 releases as soon as the last request ends.
    """

    def __init__(self, gpu: Gpu, *, idle_release_s: float = 0.5) -> None:
        if not idle_release_s >= 0:
            raise InvalidArgument(f"idle_release_s={idle_release_s!r} must be >= 0 seconds")
        self.gpu, self.idle_release_s = gpu, idle_release_s
        self._cv = threading.Condition()
        self._inflight = 0
        self._held = False
        self._acquiring = False
        self._draining = False
        self._last_exit = time.monotonic()
        self._closed = False
        self.turns = 0
        self.acquire_waits: list[float] = []
        self._thread = threading.Thread(target=self._monitor, name=f"rota-gate-{gpu.tenant}", daemon=True)
        self._thread.start()

    @property
    def held(self) -> bool:
        return self._held

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """``with gate.turn():`` — the block runs while this tenant holds its group."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def enter(self) -> None:
        with self._cv:
            while self._draining:
                self._cv.wait()
            self._inflight += 1
            try:
                while not self._held:
                    if self._acquiring:
                        self._cv.wait()
                        continue
                    self._acquiring = True
                    self._cv.release()
                    try:
                        t0 = time.monotonic()
                        self.gpu.acquire()
                        self.acquire_waits.append(time.monotonic() - t0)
                    finally:
                        self._cv.acquire()
                        self._acquiring = False
                        self._cv.notify_all()
                    self._held = True
                    self.turns += 1
            except BaseException:
                self._inflight -= 1
                self._cv.notify_all()
                raise

    def exit(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._last_exit = time.monotonic()
            self._cv.notify_all()

    def release_now(self) -> None:
        """Release the turn once nothing is in flight (used on shutdown)."""
        with self._cv:
            self._draining = True
            while self._inflight:
                self._cv.wait(1.0)
            self._release_locked()
            self._draining = False
            self._cv.notify_all()

    def close(self) -> None:
        self.release_now()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(5)

    def _release_locked(self) -> None:
        if self._held:
            self._held = False
            try:
                self.gpu.release()
            except RotaError as exc:
                log.warning("release of %s failed: %s", self.gpu.tenant, exc)

    def _monitor(self) -> None:
        with self._cv:
            while not self._closed:
                self._cv.wait(0.05)
                if not self._held or self._acquiring:
                    continue
                if self.gpu.should_yield and not self._draining:
                    self._draining = True  # new requests wait; the ones in flight finish
                if self._inflight:
                    continue
                if self._draining or time.monotonic() - self._last_exit >= self.idle_release_s:
                    self._release_locked()
                    self._draining = False
                    self._cv.notify_all()


# --------------------------------------------------------------------------- proxy


class TurnProxy(http.server.ThreadingHTTPServer):
    """An HTTP reverse proxy to ``upstream`` that runs each GPU request inside a turn."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, listen: tuple[str, int], upstream: str, gate: TurnGate, *, app: str,
                 request_timeout_s: float = 600.0, free_paths: frozenset[str] = FREE_PATHS) -> None:
        self.upstream = check_base_url(upstream, "upstream")
        self.gate, self.app, self.request_timeout_s, self.free_paths = gate, app, request_timeout_s, free_paths
        super().__init__(listen, _ProxyHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def start(self) -> TurnProxy:
        threading.Thread(target=self.serve_forever, name="rota-proxy", daemon=True).start()
        return self


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: TurnProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("proxy: " + fmt, *args)

    def _error(self, code: int, message: str) -> None:
        raw = json.dumps({"error": {"message": message, "type": "rota", "code": code}}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _handle(self) -> None:
        length = self.headers.get("Content-Length")
        try:
            n = int(length) if length else 0
        except ValueError:
            return self._error(400, f"Content-Length {length!r} is not a number")
        body = self.rfile.read(n) if n else None
        path = urllib.parse.urlsplit(self.path).path
        if path in CONTROL_PATHS:
            return self._error(409, f"{path} is managed by rota (the engine sleeps and wakes with its turns); "
                                    "use `rota` to park it, or call the engine's own port directly")
        if path in self.server.free_paths:
            return self._forward(body)
        try:
            self.server.gate.enter()
        except RotaError as exc:
            return self._error(503, f"could not get a turn for {self.server.gate.gpu.tenant!r}: {exc}")
        try:
            self._forward(body)
        finally:
            self.server.gate.exit()

    def _forward(self, body: bytes | None) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        try:
            conn = _connect(self.server.upstream, self.server.request_timeout_s)
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            return self._error(502, f"{self.server.app} server at {self.server.upstream} failed: {exc}")
        try:
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            size = resp.getheader("Content-Length")
            if size is not None:
                self.send_header("Content-Length", size)
                self.end_headers()
                self.wfile.write(resp.read())
                return
            self.send_header("Transfer-Encoding", "chunked")  # streamed (SSE): relay chunk by chunk
            self.end_headers()
            while chunk := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


# ---------------------------------------------------------------------- supervisor


@dataclass
class ServeConfig:
    """Everything :func:`serve_app` needs; each field is checked by :meth:`check`."""

    app: str
    command: Sequence[str]  # the engine's command line (its port is ``engine_port``)
    engine_port: int
    listen: str = "127.0.0.1:8000"
    env: Mapping[str, str] = field(default_factory=dict)
    group: str | None = None
    tenant: str | None = None
    orchestrator: str | None = None
    agent: str | None = None
    mode: ParkMode | None = None
    footprint_bytes: int = 0  # device bytes of the awake engine (0 = unknown; see EndpointParker)
    idle_release_s: float = 0.5
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 600.0
    http_timeout_s: float = 300.0
    check_version: Callable[[EndpointClient], None] | None = None

    def check(self) -> None:
        if self.app not in _APPS:
            raise InvalidArgument(f"app {self.app!r} is not one of {', '.join(_APPS)}")
        if not self.command:
            raise InvalidArgument("the engine command is empty")
        if not 0 < self.engine_port < 65536:
            raise InvalidArgument(f"engine port {self.engine_port} is not in 1..65535")
        check_listen(self.listen)
        if self.footprint_bytes < 0:
            raise InvalidArgument(f"footprint_bytes={self.footprint_bytes} must be >= 0 (0 = unknown)")
        for name in ("idle_release_s",):
            if not getattr(self, name) >= 0:
                raise InvalidArgument(f"{name}={getattr(self, name)!r} must be >= 0 seconds")
        for name in ("ready_timeout_s", "request_timeout_s", "http_timeout_s"):
            if not getattr(self, name) > 0:
                raise InvalidArgument(f"{name}={getattr(self, name)!r} must be > 0 seconds")


@dataclass
class Served:
    """A running engine + proxy + rota tenant, as :func:`serve_app` builds it."""

    config: ServeConfig
    process: subprocess.Popen
    client: EndpointClient
    gpu: Gpu
    parker: EndpointParker
    gate: TurnGate
    proxy: TurnProxy
    workload: Any = None  # rota_agent.WorkloadClient when registered with an agent

    @property
    def url(self) -> str:
        """The proxy's base URL: what clients should call."""
        return self.proxy.url

    def wait(self, stop: threading.Event | None = None) -> int:
        """Block until the engine exits or ``stop`` is set; return the engine's exit code (or 0)."""
        while self.process.poll() is None:
            if stop is not None and stop.wait(0.5):
                return 0
            if stop is None:
                time.sleep(0.5)
        return int(self.process.returncode or 0)

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the proxy, give the turn back, leave rota, stop the engine."""
        self.proxy.shutdown()
        self.proxy.server_close()
        with contextlib.suppress(Exception):
            self.gate.close()
        if self.workload is not None:
            with contextlib.suppress(Exception):
                self.workload.close()
        with contextlib.suppress(Exception):
            self.gpu.pm.unregister(self.parker)
        self.gpu.close()
        stop_process(self.process, timeout_s)


def stop_process(proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    """SIGTERM the engine's process group, then SIGKILL after ``timeout_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


def serve_app(config: ServeConfig) -> Served:
    """Start the engine, wait for it, join rota, register with the agent, start the proxy.

    The engine starts parked-able but awake; this tenant does not hold its group until
    the first GPU request arrives. On any failure everything started is stopped again.
    """
    import rota

    config.check()
    env = {**os.environ, **config.env}
    log.info("starting %s: %s", config.app, " ".join(config.command))
    proc = subprocess.Popen(list(config.command), env=env, start_new_session=True)
    client = EndpointClient(config.app, f"http://127.0.0.1:{config.engine_port}", timeout_s=config.http_timeout_s)
    gpu = None
    try:
        client.wait_ready(config.ready_timeout_s, alive=lambda: proc.poll() is None)
        if config.check_version is not None:
            config.check_version(client)
        gpu = rota.connect(group=config.group, tenant=config.tenant, endpoint=config.orchestrator)
        parker = track_endpoint(gpu, client, mode=config.mode, footprint_bytes=config.footprint_bytes)
        wait_attached(gpu)
        workload = None
        agent = config.agent if config.agent is not None else os.environ.get("ROTA_AGENT", "")
        if agent:
            import rota_agent

            workload = rota_agent.register(gpu, agent, tags=APP_TAGS[config.app])
        gate = TurnGate(gpu, idle_release_s=config.idle_release_s)
        proxy = TurnProxy(check_listen(config.listen), client.base_url, gate, app=config.app,
                          request_timeout_s=config.request_timeout_s).start()
    except BaseException:
        if gpu is not None:
            gpu.close()
        stop_process(proc, 10)
        raise
    log.info("%s of tenant %s (group %s) served at %s (engine at %s)", config.app, gpu.tenant, gpu.group,
             proxy.url, client.base_url)
    return Served(config, proc, client, gpu, parker, gate, proxy, workload)


__all__ = ["APP_TAGS", "CONTROL_PATHS", "FREE_PATHS", "SGLANG", "VLLM", "EndpointClient", "EndpointParker",
           "ServeConfig", "Served", "ServingError", "TurnGate", "TurnProxy", "check_base_url", "check_listen",
           "check_tags", "free_port", "serve_app", "stop_process", "track_endpoint",
           "wait_attached"]
