"""rota plugin of rota-serving: adds its own hook spec, ``rota_register_with_agent``, to rota's plugin managers.

Registered under the ``rota`` entry-point group (rota-serving brings no commands: ``rota vllm
serve`` and ``rota sglang serve`` are the adapters'). rota_agent_client implements the hook.
"""

from __future__ import annotations

from typing import Any

from rota import hookimpl


@hookimpl
def rota_add_hookspecs(pluginmanager: Any) -> None:
    """Add :mod:`rota_serving.hookspecs` (registration of a served engine with a node agent)."""
    from rota_serving import hookspecs

    pluginmanager.add_hookspecs(hookspecs)
