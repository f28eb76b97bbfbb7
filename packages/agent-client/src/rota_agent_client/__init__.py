"""rota_agent_client: the tenant side of rota's node agent (the WorkloadChannel client).

Installed in tenant processes (trainers, served engines) without the agent itself:
:func:`register` lets the node's agent park and restore this job's ``Gpu``;
:class:`WorkloadClient` does the same with a tenant's own callables.
"""

from __future__ import annotations

from rota_agent_client.client import WorkloadClient, register, restore_gpu

__all__ = ["WorkloadClient", "register", "restore_gpu"]
