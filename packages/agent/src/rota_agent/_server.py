"""Serving an :class:`~rota_agent._agent.Agent`: gRPC server, health, and an in-process runner.

``serve_agent`` adds SnapshotAgentService and ``grpc.health.v1.Health`` (overall and
per-service status SERVING; NOT_SERVING while shutting down), as the Kubernetes
DaemonSet of rota-scheduler-k8s probes it. ``running_agent`` serves one on its own
event-loop thread for tests and benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from rota._generated import snapshot_agent_pb2 as pb
from rota._generated import snapshot_agent_pb2_grpc as pb_grpc
from rota._grpc_server import bind, free_port, health_servicer, serve_in_thread
from rota_agent._agent import Agent, AgentService

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["SnapshotAgentService"].full_name


async def serve_agent(agent: Agent, listen: str) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """Start serving ``agent`` on ``listen`` (HOST:PORT or unix:PATH)."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_SnapshotAgentServiceServicer_to_server(AgentService(agent), server)
    hs = await health_servicer((SERVICE_NAME,))
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    bind(server, listen)
    await server.start()
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

    async def start() -> tuple[Agent, object]:
        server, hs = await serve_agent(agent, listen)
        agent._loop = asyncio.get_running_loop()  # type: ignore[attr-defined]

        async def stop() -> None:
            await shutdown(agent, server, hs, 0.5)

        return agent, stop

    with serve_in_thread(start, name="rota-agent"):
        yield listen, agent
