"""``app_endpoint``: park an inference server through its own HTTP sleep/wake API.

The protocol (vLLM ``/sleep``, ``/wake_up``, ``/is_sleeping``; SGLang
``/release_memory_occupation``, ``/resume_memory_occupation``) is core's :mod:`rota.engines`.

Which URLs: only the endpoints the job itself registered over its WorkloadChannel
(:func:`check_endpoints`, rota-owned ``RegisterWorkloadExt``). A Snapshot or Restore may
name a subset of them, never another URL: the agent is no proxy for its callers.
Redirects are not followed, answers are read up to ``MAX_ANSWER`` bytes, and what a
failed call reports to the agent's callers is its status (``HTTP 500``, ``no HTTP
answer``), never the server's body. (rota_serving's ``EndpointClient`` speaks the same
protocol inside a served engine's own process, where the server's words are shown; the
two packages never import each other.)

Every endpoint of the job (e.g. one per data-parallel replica) is called at once; each
request has a deadline (``timeout_s``). The calls run on this backend's own threads
(``THREADS``), at most one at a time per server (host:port), so a server that never
answers holds one thread, not the agent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, ClassVar

from rota import engines
from rota.config import shown
from rota.errors import PermissionDenied
from rota.types import ParkMode
from rota.wire import snapshot_agent_pb2 as pb
from rota_agent.backends._base import Job, Moved, check_tag_names
from rota_agent.errors import BackendFailed, BadBackendConfig, UnknownJob

log = logging.getLogger(__name__)

MAX_ENDPOINTS = 16  # endpoints one job may register
MAX_URL_CHARS = 512
MAX_ANSWER = 64 << 10  # bytes of an answer read; a longer one fails the call
THREADS = 8  # HTTP calls in flight across all servers
APP_NAMES = {pb.APP_VLLM: engines.VLLM, pb.APP_SGLANG: engines.SGLANG}  # the wire's App -> rota.engines


@dataclass(frozen=True)
class EndpointPlan:
    app: int
    endpoints: tuple[str, ...]
    mode: int
    tags: tuple[str, ...]


def check_endpoints(app: int, endpoints: Any, where: str, job_id: str = "") -> tuple[str, ...]:
    """Validate a job's registered ``app`` and base URLs; return the URLs without trailing slashes."""
    if app not in APP_NAMES:
        raise BadBackendConfig(f"{where}: app={app} is not APP_VLLM (1) or APP_SGLANG (2)", job_id=job_id)
    eps = list(endpoints)
    if not eps or len(eps) > MAX_ENDPOINTS:
        raise BadBackendConfig(f"{where}: give 1 to {MAX_ENDPOINTS} endpoints (got {len(eps)}), each the "
                               "server's base URL, e.g. http://127.0.0.1:8000", job_id=job_id)
    out = []
    for ep in eps:
        u = urllib.parse.urlsplit(ep) if len(ep) <= MAX_URL_CHARS and ep.isascii() and ep.isprintable() else None
        try:
            port_ok = u is not None and (u.port is None or 0 < u.port < 65536)
        except ValueError:
            port_ok = False
        if u is None or not port_ok or u.scheme not in ("http", "https") or not u.hostname or u.query \
                or u.fragment or u.username is not None or " " in ep:
            raise BadBackendConfig(f"{where}: endpoint {shown(ep)} is not a base URL like http://HOST:PORT (at most "
                                   f"{MAX_URL_CHARS} printable ASCII characters, no user, query or fragment)",
                                   job_id=job_id)
        out.append(ep.rstrip("/"))
    return tuple(out)


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A 3xx answer is an answer (it fails the call), not a new URL to call."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class AppEndpointBackend:
    name: ClassVar[str] = "app_endpoint"
    whole_process: ClassVar[bool] = False

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="rota-http")
        self._slots: dict[str, asyncio.Semaphore] = {}  # host:port -> one call at a time (on the agent's loop)

    def parse(self, job: Job | None, job_id: str, config: pb.AppEndpointConfig | None) -> EndpointPlan:
        where = f"app_endpoint config of job {job_id!r}"
        if job is None:
            raise UnknownJob(f"job {job_id!r} is not registered with this agent; the app_endpoint backend calls only "
                             "the endpoints a registered job declared (rota_agent.WorkloadClient(..., app=, "
                             "endpoints=))", job_id=job_id)
        if not job.endpoints:
            raise BadBackendConfig(f"{where}: the job registered no endpoints; register its servers' base URLs "
                                   "with its WorkloadChannel (rota_agent.WorkloadClient(..., app=, endpoints=))",
                                   job_id=job_id)
        config = config or pb.AppEndpointConfig()
        if config.app and config.app != job.app:
            raise BadBackendConfig(f"{where}: app={config.app} is not the app the job registered ({job.app})",
                                   job_id=job_id)
        asked = list(config.endpoints)
        if len(asked) > MAX_ENDPOINTS:
            raise BadBackendConfig(f"{where}: {len(asked)} endpoints; at most {MAX_ENDPOINTS}", job_id=job_id)
        for ep in asked:
            if ep.rstrip("/") not in job.endpoints:
                raise PermissionDenied(f"{where}: endpoint {shown(ep)} is not one the job registered; the agent "
                                       "calls only its registered endpoints (omit endpoints to use them all)",
                                       job_id=job_id)
        if config.mode not in (pb.SUSPEND_MODE_UNSPECIFIED, pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD):
            raise BadBackendConfig(f"{where}: mode {config.mode} is not a SuspendMode", job_id=job_id)
        mode = config.mode or job.capabilities.default_mode or pb.SUSPEND_MODE_OFFLOAD
        eps = tuple(dict.fromkeys(ep.rstrip("/") for ep in asked)) or job.endpoints
        return EndpointPlan(job.app, eps, mode, check_tag_names(config.tags, f"{where}: tags", job_id))

    def _http(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """One call. A failure's message has the status only, never the server's answer or the
        network error (the log has that): it goes back to the agent's remote callers."""
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with _OPENER.open(req, timeout=self.timeout_s) as resp:
                raw = resp.read(MAX_ANSWER + 1)
        except urllib.error.HTTPError as exc:
            exc.close()
            raise BackendFailed(f"{method} {url} answered HTTP {exc.code}") from None
        except (urllib.error.URLError, OSError) as exc:
            log.info("%s %s: no HTTP answer (%r)", method, url, str(getattr(exc, "reason", exc)))
            raise BackendFailed(f"{method} {url} got no HTTP answer (connection failed or timed out)") from None
        if len(raw) > MAX_ANSWER:
            raise BackendFailed(f"{method} {url} answered more than {MAX_ANSWER} bytes; a sleep/wake answer is small")
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            return raw.decode(errors="replace")

    def _one(self, plan: EndpointPlan, ep: str, sleep: bool) -> None:
        """Sleep (``sleep=True``) or wake one endpoint and check its state, synchronously."""
        app = APP_NAMES[plan.app]
        mode = ParkMode.DISCARD if plan.mode == pb.SUSPEND_MODE_DISCARD else ParkMode.OFFLOAD
        step = engines.sleep_step(app, mode, plan.tags) if sleep else engines.wake_step(app, plan.tags)
        self._http(step.method, ep + step.path, step.body)
        if step.expect_sleeping is None:
            return
        wrong = engines.sleeping_mismatch(self._http("GET", ep + engines.IS_SLEEPING), step.expect_sleeping)
        if wrong:
            raise BackendFailed(f"{ep}: after {'sleep' if sleep else 'wake_up'} the server reports {wrong}; "
                                f"expected {step.expect_sleeping}")

    def _slot(self, ep: str) -> asyncio.Semaphore:
        server = urllib.parse.urlsplit(ep).netloc.lower()
        if len(self._slots) > 4 * MAX_ENDPOINTS * THREADS:  # forget idle servers
            self._slots = {k: v for k, v in self._slots.items() if v.locked()}
        return self._slots.setdefault(server, asyncio.Semaphore(1))

    async def _call(self, plan: EndpointPlan, ep: str, sleep: bool) -> None:
        """One endpoint's step on this backend's threads; its server's slot is held until the thread is done
        (also when the operation gave up waiting), so a silent server never holds more than one thread."""
        slot = self._slot(ep)
        await slot.acquire()
        loop = asyncio.get_running_loop()

        def free(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone: the agent stopped
                loop.call_soon_threadsafe(slot.release)

        try:
            work = self._pool.submit(self._one, plan, ep, sleep)
        except BaseException:
            slot.release()
            raise
        work.add_done_callback(free)
        await asyncio.wrap_future(work)

    async def _all(self, job: Job, plan: EndpointPlan, sleep: bool) -> Moved:
        await asyncio.gather(*(self._call(plan, ep, sleep) for ep in plan.endpoints))
        return Moved()

    async def snapshot(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, True)

    async def restore(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, False)
