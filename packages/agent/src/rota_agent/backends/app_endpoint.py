"""``app_endpoint``: park an inference server through its own HTTP sleep/wake API.

* vLLM (``vllm serve --enable-sleep-mode``): ``POST /sleep?level=1`` offloads weights
  to host and drops the KV cache, ``level=2`` drops both (DISCARD);
  ``POST /wake_up[?tags=weights&tags=kv_cache]`` brings them back;
  ``GET /is_sleeping`` → ``{"is_sleeping": bool}`` is checked after each step.
* SGLang: ``POST /release_memory_occupation`` and ``POST /resume_memory_occupation``
  with ``{"tags": [...]}`` (omitted = everything).

Every endpoint of the job (e.g. one per data-parallel replica) is called at once; each
request has a deadline (``timeout_s``). A non-2xx answer or a server that still
reports the wrong sleeping state fails the step with the server's own words.
"""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, ClassVar

from rota._generated import snapshot_agent_pb2 as pb
from rota_agent.backends._base import Job, Moved
from rota_agent.errors import BackendFailed, BadBackendConfig


@dataclass(frozen=True)
class EndpointPlan:
    app: int
    endpoints: tuple[str, ...]
    mode: int
    tags: tuple[str, ...]


class AppEndpointBackend:
    name: ClassVar[str] = "app_endpoint"
    whole_process: ClassVar[bool] = False

    def __init__(self, timeout_s: float = 300.0) -> None:
        self.timeout_s = timeout_s

    def parse(self, job: Job | None, job_id: str, config: pb.AppEndpointConfig | None) -> EndpointPlan:
        where = f"app_endpoint config of job {job_id!r}"
        if config is None:
            raise BadBackendConfig(f"{where}: missing; set backend_config.app_endpoint with app and endpoints")
        if config.app not in (pb.APP_VLLM, pb.APP_SGLANG):
            raise BadBackendConfig(f"{where}: app={config.app} is not APP_VLLM (1) or APP_SGLANG (2)", job_id=job_id)
        if not config.endpoints:
            raise BadBackendConfig(f"{where}: endpoints is empty; give the server's base URL, e.g. "
                                   "http://127.0.0.1:8000", job_id=job_id)
        eps = []
        for ep in config.endpoints:
            u = urllib.parse.urlsplit(ep)
            if u.scheme not in ("http", "https") or not u.hostname or u.query or u.fragment:
                raise BadBackendConfig(f"{where}: endpoint {ep!r} is not a base URL like http://HOST:PORT",
                                       job_id=job_id)
            eps.append(ep.rstrip("/"))
        if config.mode not in (pb.SUSPEND_MODE_UNSPECIFIED, pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD):
            raise BadBackendConfig(f"{where}: mode {config.mode} is not a SuspendMode", job_id=job_id)
        tags = tuple(config.tags)
        if any(not t.strip() for t in tags):
            raise BadBackendConfig(f"{where}: empty tag in {list(tags)!r}", job_id=job_id)
        return EndpointPlan(config.app, tuple(eps), config.mode or pb.SUSPEND_MODE_OFFLOAD, tags)

    def _http(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else (b"" if method == "POST" else None)
        req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:300].decode(errors="replace")
            raise BackendFailed(f"{method} {url} answered HTTP {exc.code}: {detail}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise BackendFailed(f"{method} {url} failed: {getattr(exc, 'reason', exc)}") from None
        try:
            return json.loads(raw) if raw.strip() else None
        except ValueError:
            return raw.decode(errors="replace")

    def call(self, method: str, url: str, body: dict[str, Any] | None = None) -> Any:
        """One HTTP call with this backend's deadline and error wording; the parsed JSON
        answer (public so rota_vllm / rota_sglang reuse this protocol code)."""
        return self._http(method, url, body)

    def step(self, plan: EndpointPlan, endpoint: str, *, sleep: bool) -> None:
        """Sleep (``sleep=True``) or wake one endpoint and check its state, synchronously."""
        self._one(plan, endpoint, sleep)

    def _one(self, plan: EndpointPlan, ep: str, sleep: bool) -> None:
        if plan.app == pb.APP_SGLANG:
            path = "/release_memory_occupation" if sleep else "/resume_memory_occupation"
            self._http("POST", ep + path, {"tags": list(plan.tags)} if plan.tags else {})
            return
        if sleep:
            level = 2 if plan.mode == pb.SUSPEND_MODE_DISCARD else 1
            self._http("POST", f"{ep}/sleep?level={level}")
        else:
            query = urllib.parse.urlencode([("tags", t) for t in plan.tags])
            self._http("POST", ep + "/wake_up" + (f"?{query}" if query else ""))
        state = self._http("GET", ep + "/is_sleeping")
        sleeping = state.get("is_sleeping") if isinstance(state, dict) else None
        if plan.tags and not sleep:
            return  # a partial wake leaves the server reporting sleep until every tag is back
        if sleeping is not sleep:
            raise BackendFailed(f"{ep}: after {'sleep' if sleep else 'wake_up'} the server reports "
                                f"is_sleeping={sleeping!r}; expected {sleep}")

    async def _all(self, job: Job, plan: EndpointPlan, sleep: bool) -> Moved:
        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(None, self._one, plan, ep, sleep) for ep in plan.endpoints))
        return Moved()

    async def snapshot(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, True)

    async def restore(self, job: Job, plan: EndpointPlan) -> Moved:
        return await self._all(job, plan, False)
