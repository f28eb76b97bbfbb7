"""rota plugin of rota-agent: ``rota agent serve|status`` and the park backends.

Registered under the ``rota`` entry-point group. Hooks: ``rota_cli`` adds ``rota agent``
(:mod:`rota_agent.cli`, imported when it runs); ``rota_add_hookspecs`` adds the agent's own
spec (:mod:`rota_agent.hookspecs`), whose ``rota_agent_backends`` offers its park backends;
a served engine's registration (``rota_register_with_agent``) is rota_agent_client's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rota import hookimpl
from rota.cli.lazy import LazyCommand

if TYPE_CHECKING:
    import click


@hookimpl
def rota_add_hookspecs(pluginmanager: Any) -> None:
    """The agent's own hook, ``rota_agent_backends``, added to each of rota's plugin managers."""
    from rota_agent import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


@hookimpl
def rota_agent_backends(step_timeout_s: float, http_timeout_s: float) -> dict[str, Any]:
    """rota_agent's own backends (the hook is the agent's: rota_agent.hookspecs)."""
    from rota_agent.backends import default_backends

    return default_backends(step_timeout_s=step_timeout_s, http_timeout_s=http_timeout_s)


@hookimpl
def rota_cli(cli: click.Group) -> None:
    cli.add_command(LazyCommand("agent", "rota_agent.cli:agent",
                                "Run or query the per-node snapshot agent (SnapshotAgentService, port 9001)."))
