"""rota plugin of rota-agent-client: a served engine's tenant registers with the node agent.

Registered under the ``rota`` entry-point group. It implements rota_serving's
``rota_register_with_agent`` hook, which ``rota vllm serve`` and ``rota sglang serve``
call when given ``--agent`` (the two packages never import each other).
"""

from __future__ import annotations

from typing import Any

from rota import hookimpl

__all__ = ["rota_register_with_agent"]


@hookimpl
def rota_register_with_agent(tenant: Any, agent: str, tags: tuple[str, ...]) -> Any:
    """Register a served engine's tenant with the agent at ``agent``; the agent's park commands then run
    the tenant's hooks."""
    from rota_agent_client.client import register

    return register(tenant, agent, tags=tags)
