"""Serving an inference engine as a rota tenant: start it, join rota, put the proxy in front.

Who calls it: ``rota vllm serve`` / ``rota sglang serve`` (:func:`rota_serving.make_serve`)
through :func:`serve_app`, and tests. The picture::

    client ──HTTP──► TurnProxy (--listen) ──HTTP──► engine (127.0.0.1:<internal port>)
                        │ TurnGate: acquire on demand,        ▲
                        │ release when idle                   │ /sleep, /wake_up … (EndpointClient)
                        └── Gpu (rota session) ── rota_park / rota_restore hooks (EndpointParker)

With ``--agent`` (or ``ROTA_AGENT``) the tenant is also registered with the node
agent, so the agent can park the engine too. That goes through the
``rota_register_with_agent`` hook (:mod:`rota_serving.hookspecs`), which rota_agent_client
implements: this package never imports the agent.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pluggy

from rota import Gpu, ParkMode
from rota.devices import env_devices
from rota.errors import InvalidArgument
from rota_serving.endpoint import EndpointClient, ServingError
from rota_serving.engines import APP_TAGS, check_app
from rota_serving.gate import TurnGate
from rota_serving.parker import EndpointParker, check_fixed_device, track_endpoint, wait_attached
from rota_serving.proxy import TurnProxy

log = logging.getLogger(__name__)


def check_listen(value: str, what: str = "--listen") -> tuple[str, int]:
    """``HOST:PORT`` → (host, port), with a message naming ``what`` on bad input."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise InvalidArgument(f"{what}={value!r} is not HOST:PORT (e.g. 0.0.0.0:8000; port 0 picks a free one)")
    return host.strip("[]"), int(port)



def register_with_agent(pm: pluggy.PluginManager, tenant: Gpu, agent: str, tags: Sequence[str]) -> Any:
    """Register ``tenant`` with the node agent at ``agent`` through the first plugin that can.

    ``pm`` is one of rota's managers, to which :mod:`rota_serving.plugin` added the hook's spec
    (``rota_add_hookspecs``). Returns the registration (its ``close()`` ends it).

    :raises ServingError: no installed plugin implements ``rota_register_with_agent``, or
        rota-serving's plugin is not loaded (``ROTA_LOAD_PLUGINS`` leaves it out).
    """
    caller = getattr(pm.hook, "rota_register_with_agent", None)
    if caller is not None and caller.spec is None:
        raise ServingError("rota-serving's plugin is not loaded, so registering with a node agent is not possible; "
                           "add rota-serving to ROTA_LOAD_PLUGINS", job_id=tenant.tenant, group_id=tenant.group)
    link = caller(tenant=tenant, agent=agent, tags=tuple(tags)) if caller is not None else None
    if link is None:
        raise ServingError(f"agent {agent!r} (--agent or ROTA_AGENT) was given, but no installed plugin registers "
                           "tenants with a node agent; pip install rota-agent-client, or leave the agent out",
                           job_id=tenant.tenant, group_id=tenant.group)
    return link


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
    # the engine's client (base_url, timeout_s): an adapter's subclass of EndpointClient parks its own way
    client_factory: Callable[[str, float], EndpointClient] | None = None

    def check(self) -> None:
        check_app(self.app)
        if not self.command:
            raise InvalidArgument("the engine command is empty")
        if not 0 < self.engine_port < 65536:
            raise InvalidArgument(f"engine port {self.engine_port} is not in 1..65535")
        check_listen(self.listen)
        if self.footprint_bytes < 0:
            raise InvalidArgument(f"footprint_bytes={self.footprint_bytes} must be >= 0 (0 = unknown)")
        if not self.idle_release_s >= 0:
            raise InvalidArgument(f"idle_release_s={self.idle_release_s!r} must be >= 0 seconds")
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
    workload: Any = None  # the agent registration (register_with_agent) when an agent was given

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
    check_fixed_device(env_devices(), f"the {config.app} engine")  # before the engine's minutes-long start
    env = {**os.environ, **config.env}
    log.info("starting %s: %s", config.app, " ".join(config.command))
    proc = subprocess.Popen(list(config.command), env=env, start_new_session=True)
    url = f"http://127.0.0.1:{config.engine_port}"
    client = (config.client_factory(url, config.http_timeout_s) if config.client_factory is not None
              else EndpointClient(config.app, url, timeout_s=config.http_timeout_s))
    gpu = workload = None
    try:
        client.wait_ready(config.ready_timeout_s, alive=lambda: proc.poll() is None)
        if config.check_version is not None:
            config.check_version(client)
        gpu = rota.connect(group=config.group, tenant=config.tenant, endpoint=config.orchestrator)
        parker = track_endpoint(gpu, client, mode=config.mode, footprint_bytes=config.footprint_bytes)
        wait_attached(gpu)
        agent = config.agent if config.agent is not None else os.environ.get("ROTA_AGENT", "")
        if agent:
            workload = register_with_agent(gpu.pm, gpu, agent, APP_TAGS[config.app])
        gate = TurnGate(gpu, idle_release_s=config.idle_release_s)
        proxy = TurnProxy(check_listen(config.listen), client.base_url, gate, app=config.app,
                          request_timeout_s=config.request_timeout_s).start()
    except BaseException:
        if workload is not None:
            with contextlib.suppress(Exception):
                workload.close()
        if gpu is not None:
            gpu.close()
        stop_process(proc, 10)
        raise
    log.info("%s of tenant %s (group %s) served at %s (engine at %s)", config.app, gpu.tenant, gpu.group,
             proxy.url, client.base_url)
    return Served(config, proc, client, gpu, parker, gate, proxy, workload)


__all__ = ["ServeConfig", "Served", "check_listen", "register_with_agent", "serve_app", "stop_process"]
