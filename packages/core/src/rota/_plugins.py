"""The plugin manager: rota's hookspecs, built-in plugins, and the ``rota`` entry points.

Built-in plugins (the gRPC lease client, the default policies, aborting collectives of
an aborted job) are registered
through the same hooks as third-party ones, so there is a single code path.

Environment:
    ROTA_LOAD_PLUGINS: comma-separated distribution names; only these entry-point
        plugins load (empty string = none). Unset = every installed plugin.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import os
import sys
import threading
from dataclasses import dataclass

import pluggy

from rota import hookspecs

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rota"
DEFAULT_PLUGINS = ("rota._tenant.lease", "rota.policies", "rota._tenant.collectives")

_lock = threading.Lock()
_manager: pluggy.PluginManager | None = None
_DISTRIBUTIONS: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, version)


def new_plugin_manager(*, load_entry_points: bool = True) -> pluggy.PluginManager:
    """Build a fresh manager with rota's specs (and each plugin's own, through ``rota_add_hookspecs``),
    the built-ins and (optionally) entry points."""
    pm = pluggy.PluginManager("rota")
    pm.add_hookspecs(hookspecs)
    # historic: every plugin registered from here on adds its own specs as it registers
    pm.hook.rota_add_hookspecs.call_historic(kwargs={"pluginmanager": pm})
    for name in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(name), name=name)
    if load_entry_points:
        _load_entry_points(pm)
    return pm


def _load_entry_points(pm: pluggy.PluginManager) -> None:
    allowed = os.environ.get("ROTA_LOAD_PLUGINS")
    wanted = None if allowed is None else {n.strip() for n in allowed.split(",") if n.strip()}
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        dist = ep.dist.name if ep.dist else ep.name
        if wanted is not None and dist not in wanted:
            continue
        seen.add(dist)
        if pm.get_plugin(ep.name) is not None:
            continue
        try:
            pm.register(ep.load(), name=ep.name)  # registering runs its rota_add_hookspecs, which may fail too
        except Exception as exc:  # a broken plugin must not break rota: one line, no traceback
            if pm.get_plugin(ep.name) is not None:
                pm.unregister(name=ep.name)
            print(f"rota: plugin {dist} ({ep.value}) failed to load: {exc}", file=sys.stderr)
            continue
        _DISTRIBUTIONS[ep.name] = (dist, ep.dist.version if ep.dist else "unknown")
    for missing in sorted((wanted or set()) - seen):
        print(f"rota: ROTA_LOAD_PLUGINS names {missing!r}, which is not installed", file=sys.stderr)


def plugin_manager() -> pluggy.PluginManager:
    """The process-wide manager, built on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = new_plugin_manager()
        return _manager


@dataclass(frozen=True)
class PluginInfo:
    """One registered plugin as ``rota plugins`` shows it."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


def describe(pm: pluggy.PluginManager) -> list[PluginInfo]:
    """List every registered plugin with its distribution, version and hooks."""
    out = []
    for name, plugin in pm.list_name_plugin():
        if plugin is None:
            continue
        hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or ()))
        dist, version = _DISTRIBUTIONS.get(name, ("rota-core (built-in)", _core_version()))
        out.append(PluginInfo(name, dist, version, hooks))
    return out


def _core_version() -> str:
    try:
        return importlib.metadata.version("rota-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
