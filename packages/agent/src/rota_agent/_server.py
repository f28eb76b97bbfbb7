"""Serving an :class:`~rota_agent._agent.Agent`: gRPC server, health, and an in-process runner.

``serve_agent`` adds SnapshotAgentService and ``grpc.health.v1.Health`` (overall and
per-service status SERVING; NOT_SERVING while shutting down), as the Kubernetes
DaemonSet of rota-scheduler-k8s probes it. ``running_agent`` serves one on its own
event-loop thread for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from rota._generated import snapshot_agent_pb2 as pb
from rota._generated import snapshot_agent_pb2_grpc as pb_grpc
from rota.errors import InvalidArgument
from rota.testing import free_port
from rota_agent._agent import Agent, AgentService

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SnapshotAgentService"].full_name


async def serve_agent(agent: Agent, listen: str) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """Start serving ``agent`` on ``listen`` (HOST:PORT or unix:PATH)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_SnapshotAgentServiceServicer_to_server(AgentService(agent), server)
    hs = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise InvalidArgument(f"cannot listen on {listen!r}: {exc}; choose another --listen") from exc
    if port == 0 and not listen.startswith("unix:"):
        raise InvalidArgument(f"cannot listen on {listen!r}: address in use or invalid; choose another --listen")
    await server.start()
    for name in ("", SERVICE_NAME):
        await hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    return server, hs


async def shutdown(agent: Agent, server: grpc.aio.Server, hs: health.aio.HealthServicer, grace: float = 1.0) -> None:
    await hs.enter_graceful_shutdown()
    await agent.stop()
    await server.stop(grace)


@contextlib.contextmanager
def running_agent(agent: Agent | None = None, *, listen: str | None = None) -> Iterator[tuple[str, Agent]]:
    """Serve an agent on its own event-loop thread; yield (endpoint, agent).

    Call the agent's methods only through its loop (``agent_call``); RPCs are fine.
    """
    listen = listen or f"127.0.0.1:{free_port()}"
    agent = agent or Agent()
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), asyncio.Event()
    holder: dict[str, BaseException] = {}

    async def main() -> None:
        server, hs = await serve_agent(agent, listen)
        agent._loop = loop  # type: ignore[attr-defined]
        ready.set()
        await stop.wait()
        await shutdown(agent, server, hs, 0.5)

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surface start-up failures to the caller
            holder["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name="rota-agent", daemon=True)
    thread.start()
    ready.wait(30)
    if "error" in holder:
        raise holder["error"]
    try:
        yield listen, agent
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
