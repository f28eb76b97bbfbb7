"""rota_serving's own hook: register a served engine's tenant with the node agent.

rota_serving's plugin (:mod:`rota_serving.plugin`) adds this spec to each of rota's plugin
managers through core's ``rota_add_hookspecs``; it is called when a served engine is given an
agent (``--agent`` or ``ROTA_AGENT``), and rota_agent_client (the agent's tenant side) implements
it. So the serving side and the agent never import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from rota import Gpu

hookspec = pluggy.HookspecMarker("rota")


@hookspec(firstresult=True)
def rota_register_with_agent(tenant: Gpu, agent: str, tags: Sequence[str]) -> Any:
    """Register ``tenant`` with the node agent at ``agent``, which then parks and restores it
    through the tenant's own ``rota_park``/``rota_restore`` hooks.

    Called by :func:`rota_serving.serve_app` (``rota vllm serve``, ``rota sglang serve``), through
    :func:`rota_serving.register_with_agent`, when an agent is given; implemented by rota_agent_client
    (:func:`rota_agent_client.register`).
    Stops at first non-None result.

    :param tenant: the served engine's rota client.
    :param agent: the agent's ``HOST:PORT`` or ``unix:PATH``.
    :param tags: the memory tags the engine can park separately.
    :returns: the registration, whose ``close()`` ends it; None if this plugin does not register.
    """
