"""rota: co-operative GPU time-slicing for RL and post-training jobs.

Jobs in one *group* take turns on its devices. A job holds the group for a *turn*;
between turns rota may *park* its device state in host memory so another job can
run, and *restores* it before the job's next turn::

    import rota
    gpu = rota.connect()                  # group/tenant/orchestrator from ROTA_* env
    rota_fsdp.track(gpu, model, optimizer)  # an adapter: what to park
    for batch in data:
        rollouts = env.collect()          # no GPU needed: others may run
        with gpu.turn():                  # acquire ... release
            loss = train_step(model, optimizer, rollouts)

With nothing configured, ``connect`` starts (or finds) an embedded orchestrator on
this host. Plugins (adapters, etcd orchestrator, schedulers) are distributions in the
``rota`` entry-point group and implement the hooks in :mod:`rota.hookspecs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota._plugins import plugin_manager
from rota._types import Grant, ParkMode, ParkPlan, ParkResult, Placement, ReleaseInfo, ReleaseRequest, TurnRequest
from rota.compat import lazy_getattr
from rota.errors import RotaError
from rota.hookspecs import hookimpl

if TYPE_CHECKING:
    from rota._tenant.client import Gpu, connect

__all__ = [
    "Gpu", "Grant", "ParkMode", "ParkPlan", "ParkResult", "Placement", "ReleaseInfo", "ReleaseRequest", "RotaError",
    "TurnRequest", "connect", "hookimpl", "plugin_manager",
]


# Gpu and connect load with the client (and grpc) on first use: the CLI and plugins import rota for its
# hooks and types, and start without them
__getattr__ = lazy_getattr(__name__, {"Gpu": "rota._tenant.client", "connect": "rota._tenant.client"})
