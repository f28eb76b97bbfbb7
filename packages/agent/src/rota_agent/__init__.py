"""rota_agent: the per-node snapshot agent of rota, and the tenant-side WorkloadChannel client.

* ``rota agent serve`` — serves ``snapshot_agent.v1alpha1.SnapshotAgentService`` and
  ``grpc.health.v1`` (default ``127.0.0.1:9001``; ``--auth-key`` for other hosts);
* :func:`register` — in a tenant: let the agent park/restore this job's ``Gpu`` (from
  :mod:`rota_agent_client`, which tenants install without the agent);
* backends: ``app_channel``, ``cuda`` (whole-process checkpoint), ``app_endpoint``
  (vLLM/SGLang HTTP sleep/wake), ``noop``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so
    # that loading the plugin (rota --help) imports none of them
    from rota_agent._agent import Agent, AgentService, Operation
    from rota_agent._server import running_agent, serve_agent
    from rota_agent_client import WorkloadClient, register, restore_gpu  # the tenant side, kept importable here

__all__ = ["Agent", "AgentService", "Operation", "WorkloadClient", "register", "restore_gpu", "running_agent",
           "serve_agent"]


_HOME = {
    "Agent": "rota_agent._agent",
    "AgentService": "rota_agent._agent",
    "Operation": "rota_agent._agent",
    "running_agent": "rota_agent._server",
    "serve_agent": "rota_agent._server",
    "WorkloadClient": "rota_agent_client",
    "register": "rota_agent_client",
    "restore_gpu": "rota_agent_client",
}
__getattr__ = lazy_getattr(__name__, _HOME)
