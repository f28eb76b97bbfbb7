"""The node agent's own hook: park backends, so a third party can add one.

rota_agent's plugin adds this spec to each of rota's plugin managers through core's
``rota_add_hookspecs`` (as pytest-xdist adds its ``newhooks`` through ``pytest_addhooks``);
any distribution in the ``rota`` entry-point group may implement it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from rota_agent.backends import Backend

hookspec = pluggy.HookspecMarker("rota")


@hookspec
def rota_agent_backends(step_timeout_s: float, http_timeout_s: float) -> dict[str, Backend] | None:
    """Park backends this plugin offers, by the name a job registers with (metadata ``rota-backend``).

    Called by ``rota agent serve``, through :func:`rota_agent.backends.available_backends`, when an
    agent starts (one plugin at a time, :func:`rota.hookspecs.call_each`); implemented by rota_agent
    (app_channel, cuda, app_endpoint, noop) and by any plugin adding a backend. Two plugins offering
    one name is an error naming both.

    :param step_timeout_s: the agent's ``--step-timeout``: how long one backend step may take.
    :param http_timeout_s: the agent's ``--http-timeout``: how long one HTTP call to a tenant's server may take.
    """
