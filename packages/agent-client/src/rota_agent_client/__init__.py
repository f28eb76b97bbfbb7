"""rota_agent_client: the tenant side of rota's node agent (the WorkloadChannel client).

Installed in tenant processes (trainers, served engines) without the agent itself:
:func:`register` lets the node's agent park and restore this job's ``Gpu``;
:class:`WorkloadClient` does the same with a tenant's own callables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so
    # that loading the plugin (rota --help) imports none of them
    from rota_agent_client.client import WorkloadClient, register, restore_gpu

__all__ = ["WorkloadClient", "register", "restore_gpu"]


_HOME = {
    "WorkloadClient": "rota_agent_client.client",
    "register": "rota_agent_client.client",
    "restore_gpu": "rota_agent_client.client",
}
__getattr__ = lazy_getattr(__name__, _HOME)
