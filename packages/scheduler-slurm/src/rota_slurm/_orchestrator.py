"""The two orchestrator calls a scheduler plugin makes: Evict a finished job, read status.

Only this module opens gRPC channels in rota_slurm. ``evict`` is what the SPANK
plugin's job epilog (through ``rota slurm epilog``) and a site Epilog= script call when
a job ends, is cancelled or times out, so its turn is released and it leaves the queue
without waiting for the orchestrator's TTL. Both need an admin token (``token=``, default
``ROTA_TOKEN``); channels use TLS when ``ROTA_TLS_CA`` is set (:func:`rota.auth.channel`).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

import grpc

from rota.auth import channel
from rota.errors import NotFound, RotaError, TransientError, from_rpc_error
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvictResult:
    """Whether the evicted job held the group or waited in its queue."""

    was_holder: bool
    was_queued: bool


def evict(endpoint: str, job_id: str, group_id: str, *, reason: str, timeout: float = 15.0,
          token: str | None = None) -> EvictResult:
    """Remove ``job_id`` from ``group_id`` at ``endpoint``; retry transient errors until ``timeout``.

    A group the orchestrator does not know (the job never acquired) is not an error.
    """
    deadline = time.monotonic() + timeout
    delay = 0.1
    with channel(endpoint, token=token) as ch:
        stub = pb_grpc.RotaServiceStub(ch)
        while True:
            left = deadline - time.monotonic()
            try:
                reply = stub.Evict(pb.EvictRequest(job_id=job_id, group_id=group_id, reason=reason),
                                   timeout=max(left, 0.5), wait_for_ready=True)
                return EvictResult(reply.was_holder, reply.was_queued)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc, job_id=job_id, group_id=group_id)
                if isinstance(err, NotFound):
                    return EvictResult(False, False)
                if not isinstance(err, TransientError) or time.monotonic() + delay > deadline:
                    raise err from None
                log.info("evict of %s from %s: %s; retrying", job_id, group_id, err)
                time.sleep(delay)
                delay = min(delay * 2, 1.0)


def evict_matching(endpoint: str, job_id: str, pattern: re.Pattern[str], *, reason: str,
                   timeout: float = 15.0, token: str | None = None) -> dict[str, EvictResult]:
    """Evict ``job_id`` from every group whose id matches ``pattern`` and where the job is still in play.

    For groups named per GPU set (``%g``): each step of a job had the group of its own
    GPUs, so the epilog looks for the job in all of them. In play: holding, queued, or
    with state kept on the device or parked (a job already evicted is ``idle``, a dead
    one ``lost``). Returns group id -> result.
    """
    deadline = time.monotonic() + timeout
    found = [g.group_id for g in group_status(endpoint, timeout=timeout, token=token) if pattern.match(g.group_id)
             and (g.holder == job_id or job_id in g.queue
                  or any(t.job_id == job_id and t.state not in ("idle", "lost") for t in g.tenants))]
    return {group: evict(endpoint, job_id, group, reason=reason, timeout=max(deadline - time.monotonic(), 1.0),
                         token=token) for group in found}


def group_status(endpoint: str, group_id: str = "", timeout: float = 10.0,
                 token: str | None = None) -> list[pb.GroupInfo]:
    """Holder, queue and tenants of one group (or all groups) at ``endpoint``."""
    with channel(endpoint, token=token) as ch:
        try:
            reply = pb_grpc.RotaServiceStub(ch).Status(pb.StatusRequest(group_id=group_id), timeout=timeout)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc, group_id=group_id)
            if isinstance(err, NotFound):
                return []
            raise err from None
    return list(reply.groups)


__all__ = ["EvictResult", "RotaError", "evict", "evict_matching", "group_status"]
