"""Built-in lease plugin: acquire and release over gRPC (``rota.v1.RotaService``).

Registered by default (see :data:`rota._plugins.DEFAULT_PLUGINS`) and marked
``trylast`` so any plugin that answers ``rota_acquire`` first takes precedence.
Transient failures (orchestrator restarting, leader changing) are retried with the
same job id, so a blocked acquire keeps its place in the queue. Everything a call needs comes
in its arguments: the request, and the tenant's :class:`~rota._tenant.link.OrchestratorLink`
(its stub, re-pointed at a new leader through ``link.follow``); nothing calls back into the
client that called the hook.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from rota._types import Grant, ReleaseInfo, ReleaseRequest, TurnRequest
from rota.errors import NotHolder, NotLeader, StaleToken, TransientError, from_rpc_error
from rota.hookspecs import hookimpl

if TYPE_CHECKING:
    from rota._tenant.link import OrchestratorLink

log = logging.getLogger(__name__)

RETRY_FOR_S = 60.0  # how long transient errors are retried before they reach the caller


def call_with_retry(fn: Callable[[], Any], *, job_id: str, group_id: str, what: str,
                    follow: Callable[[str], None] | None = None) -> Any:
    """Call ``fn``; on a transient gRPC error retry with backoff for RETRY_FOR_S.

    A replica that does not lead names the leader; ``follow(leader)`` re-points the
    client there and the call is retried at once.
    """
    import grpc  # here, not at import: core registers this plugin in every process, the CLI's included

    deadline = time.monotonic() + RETRY_FOR_S
    delay = 0.05
    while True:
        try:
            return fn()
        except grpc.RpcError as exc:
            err = from_rpc_error(exc, job_id=job_id, group_id=group_id)
            if not isinstance(err, TransientError) or time.monotonic() > deadline:
                raise err from None
            if isinstance(err, NotLeader) and err.leader and follow is not None:
                follow(err.leader)
                time.sleep(0.01)
                continue
            log.info("%s of %s in %s: %s; retrying in %.2f s", what, job_id, group_id, err, delay)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


@hookimpl(trylast=True)
def rota_acquire(request: TurnRequest, link: OrchestratorLink) -> Grant:
    from rota._generated import rota_v1_pb2 as pb

    msg = pb.TurnRequest(job_id=request.job_id, group_id=request.group_id, priority=request.priority,
                         weight=request.weight, world_size=request.world_size, rank=request.rank,
                         footprint_bytes=request.footprint_bytes, devices=list(request.devices),
                         quiet=request.quiet)
    reply = call_with_retry(lambda: link.stub.Acquire(msg, wait_for_ready=True), job_id=request.job_id,
                            group_id=request.group_id, what="acquire", follow=link.follow)
    return Grant(request.job_id, request.group_id, reply.token, reply.waited_ms, reply.context_restored,
                 reply.ttl_ms, reply.max_turn_ms, reply.device)


@hookimpl(trylast=True)
def rota_release(request: ReleaseRequest, link: OrchestratorLink) -> ReleaseInfo:
    from rota._generated import rota_v1_pb2 as pb

    grant = request.grant
    msg = pb.ReleaseRequest(job_id=grant.job_id, group_id=grant.group_id, token=grant.token, rank=request.rank,
                            footprint_bytes=request.footprint_bytes, restore_seconds=request.restore_seconds)
    attempts = 0

    def release() -> Any:
        nonlocal attempts
        attempts += 1
        return link.stub.Release(msg)

    try:
        reply = call_with_retry(release, job_id=grant.job_id, group_id=grant.group_id, what="release",
                                follow=link.follow)
    except (NotHolder, StaleToken) as exc:
        if attempts == 1:
            raise
        # An earlier attempt was committed by an orchestrator that failed before it answered
        # (or the turn was ended meanwhile): either way this turn is over, as asked.
        log.info("release of %s in %s: already done by an earlier attempt (%s)", grant.job_id, grant.group_id, exc)
        return ReleaseInfo(0, False, group_released=True)
    return ReleaseInfo(reply.pending_waiters, reply.snapshot_deferred, reply.group_released)
