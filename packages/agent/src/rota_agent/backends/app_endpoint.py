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
call has one deadline for all of it (``timeout_s``: ``--http-timeout``, 30 s). Calls are
asyncio I/O on the agent's loop, no threads: a server that never answers holds one socket
of its own job until its deadline, and nothing another job's call waits for. In flight at
once: one call per server address (however the URL spells it), ``JOB_CALLS`` per job,
``OWNER_CALLS`` per owner and ``CALLS`` in all, the last handed out fairly: a freed slot
goes to the waiting owner with the fewest calls in flight, so one owner's many jobs (or
many tokens) cannot keep another owner's first call waiting behind theirs.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import http.client
import io
import json
import logging
import re
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
MAX_HEAD = 16 << 10  # bytes of an answer's status line and headers
CALLS = 256  # HTTP calls in flight across all servers (sockets; slots handed out fairly by owner)
JOB_CALLS = 2  # ... of one job
OWNER_CALLS = 4  # ... of one owner's jobs
DEFAULT_TIMEOUT_S = 30.0  # one call, connect to last byte (--http-timeout)
_STATUS = re.compile(rb"HTTP/1\.[01] ([1-5][0-9][0-9])(?: [^\r\n]*)?\r\n")
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


class _NotHttp(Exception):
    """The peer's bytes are no HTTP answer (the words stay in the log)."""


class _TooLong(Exception):
    """The answer is longer than MAX_ANSWER."""


class FairSlots:
    """``n`` slots shared by owners: while any wait, a freed slot goes to the waiting owner with the fewest slots
    held (first come among equals), so an owner's first call never waits behind another's tenth. Loop-only."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.held: collections.Counter[object] = collections.Counter()
        self._waiting: list[tuple[object, asyncio.Future]] = []

    async def acquire(self, owner: object) -> None:
        if self.free and not self._waiting:
            self.free -= 1
            self.held[owner] += 1
            return
        fut = asyncio.get_running_loop().create_future()
        self._waiting.append((owner, fut))
        try:
            await fut  # resolved by release, which counted the slot as ours
        except BaseException:
            if fut.done() and not fut.cancelled():
                self.release(owner)  # handed over as we were cancelled: pass it on
            elif (owner, fut) in self._waiting:
                self._waiting.remove((owner, fut))
            raise

    def release(self, owner: object) -> None:
        self.held[owner] -= 1
        if self.held[owner] <= 0:
            del self.held[owner]
        live = [(o, f) for o, f in self._waiting if not f.done()]
        self._waiting = live
        if not live:
            self.free += 1
            return
        pick = min(range(len(live)), key=lambda i: (self.held[live[i][0]], i))
        owner_next, fut = self._waiting.pop(pick)
        self.held[owner_next] += 1
        fut.set_result(None)


class AppEndpointBackend:
    name: ClassVar[str] = "app_endpoint"
    whole_process: ClassVar[bool] = False

    def __init__(self, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._slots: dict[object, asyncio.Semaphore] = {}  # Target / job / owner -> its calls (on the agent's loop)
        self._calls = FairSlots(CALLS)

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

    async def _http(self, method: str, url: str, pids: dict[int, int], body: dict[str, Any] | None = None) -> Any:
        """One call to the checked address of ``url``, if the job's processes ``pids`` still own it. A failure's
        message is a fixed category, never the server's bytes or the network error (the log has those): it goes
        back to the agent's remote callers."""
        where = address(url)
        assert where is not None  # check_endpoints refused the URL otherwise
        why = await asyncio.to_thread(owned, where, pids)  # /proc reads, off the loop
        if why:
            raise BackendFailed(f"{method} {url} not called: {why}")
        u = urllib.parse.urlsplit(url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n").encode()
        try:
            status, raw = await asyncio.wait_for(self._exchange(where, u.scheme == "https", head + data),
                                                 self.timeout_s)
        except asyncio.TimeoutError:
            raise BackendFailed(f"{method} {url} timed out after {self.timeout_s:g} s (--http-timeout)") from None
        except _TooLong:
            raise BackendFailed(f"{method} {url} answered more than {MAX_ANSWER} bytes; a sleep/wake answer is "
                                "small") from None
        except _NotHttp as exc:
            log.info("%s %s: no HTTP answer (%s)", method, url, exc)
            raise BackendFailed(f"{method} {url} did not answer in HTTP") from None
        except (ConnectionError, ssl.SSLError, OSError) as exc:
            log.info("%s %s: could not connect (%r)", method, url, exc)
            raise BackendFailed(f"{method} {url} could not connect (refused, reset or TLS failed)") from None
        if status >= 300:
            raise BackendFailed(f"{method} {url} answered HTTP {status}")
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            return raw.decode(errors="replace")

    @staticmethod
    async def _exchange(where: Target, tls: bool, request: bytes) -> tuple[int, bytes]:
        """Send ``request`` to ``where`` and read one answer: (status, body of at most MAX_ANSWER bytes)."""
        reader, writer = await asyncio.open_connection(
            str(where.ip), where.port, ssl=ssl.create_default_context() if tls else None,
            server_hostname=str(where.ip) if tls else None, limit=MAX_HEAD)
        try:
            writer.write(request)
            await writer.drain()
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.LimitOverrunError, asyncio.IncompleteReadError) as exc:
                raise _NotHttp(type(exc).__name__) from None
            line = _STATUS.match(head)
            if line is None:
                raise _NotHttp("no HTTP/1.x status line")
            try:
                headers = http.client.parse_headers(io.BytesIO(head[line.end():]))
            except http.client.HTTPException as exc:
                raise _NotHttp(type(exc).__name__) from None
            return int(line.group(1)), await _body(reader, headers)
        finally:
            writer.close()

    async def _one(self, plan: EndpointPlan, ep: str, sleep: bool, pids: dict[int, int]) -> None:
        """Sleep (``sleep=True``) or wake one endpoint and check its state."""
        app = APP_NAMES[plan.app]
        mode = ParkMode.DISCARD if plan.mode == pb.SUSPEND_MODE_DISCARD else ParkMode.OFFLOAD
        step = engines.sleep_step(app, mode, plan.tags) if sleep else engines.wake_step(app, plan.tags)
        await self._http(step.method, ep + step.path, pids, step.body)
        if step.expect_sleeping is None:
            return
        wrong = engines.sleeping_mismatch(await self._http("GET", ep + engines.IS_SLEEPING, pids),
                                          step.expect_sleeping)
        if wrong:
            raise BackendFailed(f"{ep}: after {'sleep' if sleep else 'wake_up'} the server reports {wrong}; "
                                f"expected {step.expect_sleeping}")

    def _slot(self, key: object, n: int) -> asyncio.Semaphore:
        if len(self._slots) > 4 * MAX_ENDPOINTS * JOB_CALLS * OWNER_CALLS:  # forget idle ones
            self._slots = {k: v for k, v in self._slots.items() if v.locked()}
        return self._slots.setdefault(key, asyncio.Semaphore(n))

    async def _call(self, job: Job, plan: EndpointPlan, ep: str, sleep: bool) -> None:
        """One endpoint's step. Its job's, owner's and server's slots (taken in that order), then a fair share
        of the ``CALLS``, are held until it ends (at its deadline at the latest), also when the operation
        gave up waiting for it: silent servers hold at most ``JOB_CALLS`` calls per job, ``OWNER_CALLS`` per
        owner, one per address, and never a slot an owner with fewer calls in flight waits for."""
        async with contextlib.AsyncExitStack() as held:
            for slot in (self._slot(("job", job.job_id), JOB_CALLS), self._slot(("owner", job.owner), OWNER_CALLS),
                         self._slot(address(ep), 1)):
                await held.enter_async_context(slot)
            await self._calls.acquire(job.owner)
            held.callback(self._calls.release, job.owner)
            await self._one(plan, ep, sleep, dict(job.proven))

    async def _all(self, job: Job, plan: EndpointPlan, sleep: bool) -> Moved:
        await asyncio.gather(*(self._call(job, plan, ep, sleep) for ep in plan.endpoints))
        return Moved()

    async def snapshot(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, True)

    async def restore(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, False)


async def _body(reader: asyncio.StreamReader, headers: http.client.HTTPMessage) -> bytes:
    """An answer's body after its headers: by Content-Length, in chunks, or to the end; _TooLong past
    MAX_ANSWER, _NotHttp when it is not what the headers say."""
    try:
        if "chunked" in (headers.get("Transfer-Encoding") or "").lower():
            out = b""
            while True:
                size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    return out
                if len(out) + size > MAX_ANSWER:
                    raise _TooLong
                out += await reader.readexactly(size)
                await reader.readexactly(2)
        length = headers.get("Content-Length")
        if length is not None:
            n = int(length)
            if n > MAX_ANSWER:
                raise _TooLong
            return await reader.readexactly(n) if n > 0 else b""
        out = await reader.read(MAX_ANSWER + 1)
        while out and len(out) <= MAX_ANSWER:
            more = await reader.read(MAX_ANSWER + 1 - len(out))
            if not more:
                break
            out += more
        if len(out) > MAX_ANSWER:
            raise _TooLong
        return out
    except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as exc:
        raise _NotHttp(type(exc).__name__) from None
