"""The two orchestrator calls a scheduler plugin makes: Evict a finished job, read status.

Both go through :mod:`rota.admin`. ``evict`` (:func:`rota.admin.evict`) is what the SPANK
plugin's job epilog (through ``rota slurm epilog``) and a site Epilog= script call when
a job ends, is cancelled or times out, so its turn is released and it leaves the queue
without waiting for the orchestrator's TTL; :func:`evict_matching` does it for every
group a ``%g`` pattern names. Both need an admin token (``token=``, default
``ROTA_TOKEN``); channels use TLS when ``ROTA_TLS_CA`` is set (:func:`rota.auth.channel`).
"""

from __future__ import annotations

import re
import time

from rota.admin import EvictResult, evict, fetch_status
from rota.errors import NotFound, RotaError
from rota.wire import rota_v1_pb2 as pb


def evict_matching(endpoint: str, job_id: str, pattern: re.Pattern[str], *, reason: str,
                   timeout: float = 15.0, token: str | None = None) -> dict[str, EvictResult]:
    """Evict ``job_id`` from every group whose id matches ``pattern`` and where the job is still in play.

    For groups named per GPU set (``%g``): each step of a job had the group of its own
    GPUs, so the epilog looks for the job in all of them. In play: holding, queued, or
    with state kept on the device or parked (a job already evicted is ``idle``, a dead
    one ``lost``, one that closed its sessions ``ended``). Returns group id -> result.
    """
    deadline = time.monotonic() + timeout
    found = [g.group_id for g in group_status(endpoint, timeout=timeout, token=token) if pattern.match(g.group_id)
             and (g.holder == job_id or job_id in g.queue
                  or any(t.job_id == job_id and t.state not in ("idle", "lost", "ended") for t in g.tenants))]
    return {group: evict(endpoint, job_id, group, reason=reason, timeout=max(deadline - time.monotonic(), 1.0),
                         token=token) for group in found}


def group_status(endpoint: str, group_id: str = "", timeout: float | None = None,
                 token: str | None = None) -> list[pb.GroupInfo]:
    """Holder, queue and tenants of one group (or all groups) at ``endpoint``; [] for a group the
    orchestrator does not have yet (its Slurm jobs are shown without orchestrator state)."""
    try:
        return list(fetch_status(endpoint, group_id, timeout, token=token).groups)
    except NotFound:
        return []


__all__ = ["EvictResult", "RotaError", "evict", "evict_matching", "group_status"]
