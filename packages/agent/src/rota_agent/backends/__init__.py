"""Park backends: one module each, all behind :class:`rota_agent.backends._base.Backend`."""

from __future__ import annotations

import pluggy

from rota.errors import ConfigError
from rota.hookspecs import call_each
from rota_agent.backends._base import Backend, Channel, Job, Moved, check_tag_names
from rota_agent.backends.app_channel import AppChannelBackend
from rota_agent.backends.app_endpoint import DEFAULT_TIMEOUT_S as HTTP_TIMEOUT_S
from rota_agent.backends.app_endpoint import AppEndpointBackend
from rota_agent.backends.cuda import CudaBackend, CudaDriver, LibCudaDriver
from rota_agent.backends.noop import NoopBackend


def default_backends(*, step_timeout_s: float = 120.0, http_timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, Backend]:
    """rota_agent's own backends, by name (what its ``rota_agent_backends`` hook offers)."""
    return {"app_channel": AppChannelBackend(), "cuda": CudaBackend(step_timeout_s=step_timeout_s),
            "app_endpoint": AppEndpointBackend(timeout_s=http_timeout_s), "noop": NoopBackend()}


def available_backends(pm: pluggy.PluginManager, *, step_timeout_s: float = 120.0,
                       http_timeout_s: float = HTTP_TIMEOUT_S) -> dict[str, Backend]:
    """Every backend an installed plugin offers through ``rota_agent_backends``, by name.

    ``pm`` is one of rota's managers, to which rota_agent's plugin added the hook's spec
    (``rota_add_hookspecs``). Called plugin by plugin (:func:`rota.hookspecs.call_each`), so that
    a name two plugins offer is an error naming both.
    """
    caller = getattr(pm.hook, "rota_agent_backends", None)
    if caller is None or caller.spec is None:
        raise ConfigError("rota-agent's plugin is not loaded, so no park backend is known; add rota-agent to "
                          "ROTA_LOAD_PLUGINS (or leave it unset)")
    found: dict[str, Backend] = {}
    owner: dict[str, str] = {}
    for plugin, offered in call_each(caller, step_timeout_s=step_timeout_s, http_timeout_s=http_timeout_s):
        for name, backend in (offered or {}).items():
            if name in found:
                raise ConfigError(f"agent backend {name!r} is offered by both {owner[name]} and {plugin}; "
                                  "uninstall one of them")
            found[name], owner[name] = backend, plugin
    return found


__all__ = ["AppChannelBackend", "AppEndpointBackend", "Backend", "Channel", "CudaBackend", "CudaDriver", "Job",
           "LibCudaDriver", "Moved", "NoopBackend", "available_backends", "check_tag_names", "default_backends"]
