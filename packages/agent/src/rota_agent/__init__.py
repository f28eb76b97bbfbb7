"""rota_agent: the per-node snapshot agent of rota, and the tenant-side WorkloadChannel client.

* ``rota agent serve`` — serves ``snapshot_agent.v1alpha1.SnapshotAgentService`` and
  ``grpc.health.v1`` (default ``127.0.0.1:9001``; ``--auth-key`` for other hosts);
* :func:`register` — in a tenant: let the agent park/restore this job's ``Gpu`` (from
  :mod:`rota_agent_client`, which tenants install without the agent);
* backends: ``app_channel``, ``cuda`` (whole-process checkpoint), ``app_endpoint``
  (vLLM/SGLang HTTP sleep/wake), ``noop``.
"""

from __future__ import annotations

from rota_agent._agent import Agent, AgentService, Operation
from rota_agent._server import running_agent, serve_agent
from rota_agent_client import WorkloadClient, register, restore_gpu  # the tenant side, kept importable here

__all__ = ["Agent", "AgentService", "Operation", "WorkloadClient", "register", "restore_gpu", "running_agent",
           "serve_agent"]
