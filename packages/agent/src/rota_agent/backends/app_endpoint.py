"""``app_endpoint``: park an inference server through its own HTTP sleep/wake API.

The protocol (vLLM ``/sleep``, ``/wake_up``, ``/is_sleeping``; SGLang
``/release_memory_occupation``, ``/resume_memory_occupation``) is core's :mod:`rota.engines`.

Which URLs: only the endpoints the job itself registered over its WorkloadChannel
(:func:`check_endpoints`, rota-owned ``RegisterWorkloadExt``), and only while the job's
proven process owns what listens there (:mod:`rota_agent.backends._listeners`: checked
at registration and before every call). A Snapshot or Restore may name a subset of them,
never another URL: the agent is no proxy and no port scanner for its callers. Calls go
to the checked address itself (``http.client``: nothing follows redirects), answers
are read up to ``MAX_ANSWER`` bytes, and a failed call reports one of a few fixed
categories (``answered HTTP 500``, ``could not connect``, ``did not answer in HTTP``),
never a byte the peer sent (the log has the details). (rota_serving's ``EndpointClient``
speaks the same protocol inside a served engine's own process, where the server's words
are shown; the two packages never import each other.)

Every endpoint of the job (e.g. one per data-parallel replica) is called at once; each
request has a deadline (``timeout_s``). The calls run on this backend's own threads
(``THREADS``): at most one at a time per server address (however the URL spells it),
``JOB_CALLS`` per job and ``OWNER_CALLS`` per owner, so silent servers hold a few
threads of their own job, never the agent.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import logging
import ssl
import urllib.parse
from dataclasses import dataclass
from typing import Any, ClassVar

from rota import engines
from rota.config import shown
from rota.errors import PermissionDenied
from rota.types import ParkMode
from rota.wire import snapshot_agent_pb2 as pb
from rota_agent.backends._base import Job, Moved, check_tag_names
from rota_agent.backends._listeners import Target, owned, target
from rota_agent.errors import BackendFailed, BadBackendConfig, UnknownJob

log = logging.getLogger(__name__)

MAX_ENDPOINTS = 16  # endpoints one job may register
MAX_URL_CHARS = 512
MAX_ANSWER = 64 << 10  # bytes of an answer read; a longer one fails the call
THREADS = 8  # HTTP calls in flight across all servers
JOB_CALLS = 2  # ... of one job
OWNER_CALLS = 4  # ... of one owner's jobs
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
        if address(ep) is None:
            raise BadBackendConfig(f"{where}: endpoint {shown(ep)} must name its server by IP address in canonical "
                                   "form (e.g. http://127.0.0.1:8000, http://[::1]:8000, or the pod IP) or "
                                   "localhost; the agent resolves no host names", job_id=job_id)
        out.append(ep.rstrip("/"))
    return tuple(out)


def address(url: str) -> Target | None:
    """The canonical address and port a checked URL's calls go to (None: its host is no canonical IP)."""
    u = urllib.parse.urlsplit(url)
    return target(u.hostname or "", u.port or (443 if u.scheme == "https" else 80))


def check_owned(job_id: str, endpoints: tuple[str, ...], pids: dict[int, int], where: str) -> None:
    """PermissionDenied unless the processes ``pids`` (pid -> start time) own every endpoint's listener."""
    for ep in endpoints:
        why = owned(address(ep), pids)  # type: ignore[arg-type]  # checked by check_endpoints
        if why:
            raise PermissionDenied(f"{where}: endpoint {shown(ep)} is refused: {why}. The agent calls only a "
                                   "server the job's own process listens on", job_id=job_id)


class AppEndpointBackend:
    name: ClassVar[str] = "app_endpoint"
    whole_process: ClassVar[bool] = False

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=THREADS, thread_name_prefix="rota-http")
        self._slots: dict[object, asyncio.Semaphore] = {}  # Target / job / owner -> its calls (on the agent's loop)

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

    def _http(self, method: str, url: str, pids: dict[int, int], body: dict[str, Any] | None = None) -> Any:
        """One call to the checked address of ``url``, if the job's processes ``pids`` still own it. A failure's
        message is a fixed category, never the server's bytes or the network error (the log has those): it goes
        back to the agent's remote callers."""
        where = address(url)
        assert where is not None  # check_endpoints refused the URL otherwise
        why = owned(where, pids)
        if why:
            raise BackendFailed(f"{method} {url} not called: {why}")
        u = urllib.parse.urlsplit(url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        if u.scheme == "https":
            conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                str(where.ip), where.port, timeout=self.timeout_s, context=ssl.create_default_context())
        else:
            conn = http.client.HTTPConnection(str(where.ip), where.port, timeout=self.timeout_s)
        try:
            conn.request(method, path, body=data, headers={"Content-Type": "application/json", "Host": u.netloc})
            resp = conn.getresponse()
            status, raw = resp.status, resp.read(MAX_ANSWER + 1)
        except TimeoutError:
            raise BackendFailed(f"{method} {url} timed out after {self.timeout_s:g} s") from None
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            log.info("%s %s: could not connect (%r)", method, url, exc)
            raise BackendFailed(f"{method} {url} could not connect (refused, reset or TLS failed)") from None
        except Exception as exc:  # http.client.HTTPException and whatever else a peer's bytes raise
            log.info("%s %s: no HTTP answer (%s)", method, url, type(exc).__name__)
            raise BackendFailed(f"{method} {url} did not answer in HTTP") from None
        finally:
            conn.close()
        if status >= 300:
            raise BackendFailed(f"{method} {url} answered HTTP {status}")
        if len(raw) > MAX_ANSWER:
            raise BackendFailed(f"{method} {url} answered more than {MAX_ANSWER} bytes; a sleep/wake answer is small")
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            return raw.decode(errors="replace")

    def _one(self, plan: EndpointPlan, ep: str, sleep: bool, pids: dict[int, int]) -> None:
        """Sleep (``sleep=True``) or wake one endpoint and check its state, synchronously."""
        app = APP_NAMES[plan.app]
        mode = ParkMode.DISCARD if plan.mode == pb.SUSPEND_MODE_DISCARD else ParkMode.OFFLOAD
        step = engines.sleep_step(app, mode, plan.tags) if sleep else engines.wake_step(app, plan.tags)
        self._http(step.method, ep + step.path, pids, step.body)
        if step.expect_sleeping is None:
            return
        wrong = engines.sleeping_mismatch(self._http("GET", ep + engines.IS_SLEEPING, pids), step.expect_sleeping)
        if wrong:
            raise BackendFailed(f"{ep}: after {'sleep' if sleep else 'wake_up'} the server reports {wrong}; "
                                f"expected {step.expect_sleeping}")

    def _slot(self, key: object, n: int) -> asyncio.Semaphore:
        if len(self._slots) > 4 * MAX_ENDPOINTS * THREADS:  # forget idle ones
            self._slots = {k: v for k, v in self._slots.items() if v.locked()}
        return self._slots.setdefault(key, asyncio.Semaphore(n))

    async def _call(self, job: Job, plan: EndpointPlan, ep: str, sleep: bool) -> None:
        """One endpoint's step on this backend's threads. Its job's, owner's and server's slots (taken in that
        order) are held until the thread is done (also when the operation gave up waiting), so silent servers
        hold at most ``JOB_CALLS`` threads per job, ``OWNER_CALLS`` per owner, one per address."""
        slots = [self._slot(("job", job.job_id), JOB_CALLS), self._slot(("owner", job.owner), OWNER_CALLS),
                 self._slot(address(ep), 1)]
        taken: list[asyncio.Semaphore] = []
        loop = asyncio.get_running_loop()

        def free(_: object = None) -> None:
            for slot in taken:
                with contextlib.suppress(RuntimeError):  # the loop is gone: the agent stopped
                    loop.call_soon_threadsafe(slot.release)

        try:
            for slot in slots:
                await slot.acquire()
                taken.append(slot)
            work = self._pool.submit(self._one, plan, ep, sleep, dict(job.proven))
        except BaseException:
            for slot in taken:
                slot.release()
            raise
        work.add_done_callback(free)
        await asyncio.wrap_future(work)

    async def _all(self, job: Job, plan: EndpointPlan, sleep: bool) -> Moved:
        await asyncio.gather(*(self._call(job, plan, ep, sleep) for ep in plan.endpoints))
        return Moved()

    async def snapshot(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, True)

    async def restore(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, False)
