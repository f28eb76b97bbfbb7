"""Administering an orchestrator over rota.v1: read the groups' status, evict a job.

The one client for callers outside the tenants: ``rota status``, rota_slurm (the job
epilog, ``rota slurm status``) and rota_k8s (``rota k8s status``, the controller that
evicts the jobs of dead pods). Channels come from :func:`rota.auth.channel`: TLS per
``ROTA_TLS_*``, every call carrying ``token`` (default ``ROTA_TOKEN``; an admin token
where the orchestrator checks callers). Failures raise :class:`rota.errors.RotaError`; an
orchestrator that does not answer in time (down, refusing, or accepting and staying silent)
is one line naming its address and the setting that governs the wait: ``timeout``, which
commands take from ``--timeout`` or ``ROTA_CONNECT_TIMEOUT_S`` (:func:`client_timeout`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import grpc

from rota.auth import channel
from rota.config import env_float
from rota.errors import DeadlineExceeded, NotFound, TransientError, Unavailable, from_rpc_error
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc

__all__ = ["ADMIN_TIMEOUT_S", "MAX_PAGES", "EvictResult", "client_timeout", "evict", "fetch_status"]

log = logging.getLogger(__name__)

MAX_PAGES = 1000  # a Status that never ends is the server's fault: stop after this many pages
ADMIN_TIMEOUT_S = 10.0  # default of --timeout / ROTA_CONNECT_TIMEOUT_S for commands that ask an orchestrator


def client_timeout(given: float | None = None) -> float:
    """Seconds a command waits for an answer: ``given`` (its ``--timeout``), else ``ROTA_CONNECT_TIMEOUT_S``,
    else :data:`ADMIN_TIMEOUT_S`."""
    return given if given is not None else env_float("ROTA_CONNECT_TIMEOUT_S", ADMIN_TIMEOUT_S)


def _no_answer(err: Exception, endpoint: str, timeout: float) -> Exception:
    """An unreachable or silent orchestrator, said as one line with its address and what to change."""
    if isinstance(err, DeadlineExceeded):
        return DeadlineExceeded(f"the orchestrator at {endpoint} did not answer within {timeout:g} s; check that "
                                "it runs there, or wait longer with --timeout or ROTA_CONNECT_TIMEOUT_S")
    if type(err) is Unavailable:
        cause = str(err).splitlines()[0][:200] if str(err) else "unavailable"
        return Unavailable(f"cannot reach the orchestrator at {endpoint} ({cause}); check that it runs there and "
                           "the address (--orchestrator or ROTA_ORCHESTRATOR)")
    return err


@dataclass(frozen=True)
class EvictResult:
    """What an eviction did: the job held the group, waited in its queue, or neither.

    ``gone``: the orchestrator has no such group (the job never acquired there, or the
    group was forgotten, or it serves a fixed ``--groups`` list without it), so the job
    is already gone from it; like an eviction of a job the group no longer holds or
    queues, that is what the caller wanted, not an error.
    """

    was_holder: bool
    was_queued: bool
    gone: bool = False


def evict(endpoint: str, job_id: str, group_id: str, *, reason: str, timeout: float = 15.0, retry: bool = True,
          token: str | None = None) -> EvictResult:
    """Take ``job_id`` out of ``group_id`` at ``endpoint``: end its turn, or drop it from the queue.

    Evicting is idempotent: a second eviction of the same job answers was_holder=False,
    was_queued=False. With ``retry``, transient errors (the orchestrator restarting, no
    leader elected yet) are retried with backoff until ``timeout`` seconds have passed;
    without it one attempt is made and a transient error is raised for the caller to
    retry later. Other errors (PermissionDenied, InvalidArgument) are raised at once.
    """
    deadline = time.monotonic() + timeout
    delay = 0.1
    request = pb.EvictRequest(job_id=job_id, group_id=group_id, reason=reason)
    with channel(endpoint, token=token) as ch:
        stub = pb_grpc.RotaServiceStub(ch)
        while True:
            try:
                reply = stub.Evict(request, timeout=max(deadline - time.monotonic(), 0.5), wait_for_ready=retry)
                return EvictResult(reply.was_holder, reply.was_queued)
            except grpc.RpcError as exc:
                err = _no_answer(from_rpc_error(exc, job_id=job_id, group_id=group_id), endpoint, timeout)
            if isinstance(err, NotFound):
                log.info("evict of job %s: %s; already gone", job_id, err)
                return EvictResult(False, False, gone=True)
            if not retry or not isinstance(err, TransientError) or time.monotonic() + delay > deadline:
                raise err
            log.info("evict of job %s from group %s: %s; retrying", job_id, group_id, err)
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def fetch_status(endpoint: str, group_id: str = "", timeout: float | None = None, *,
                 token: str | None = None) -> pb.StatusReply:
    """Holder, queue, residents and per-tenant accounting of one group (or all), every page, all within
    ``timeout`` seconds (default :func:`client_timeout`).

    A ``group_id`` the orchestrator does not have raises :class:`rota.errors.NotFound`
    naming it and the groups it knows.
    """
    timeout = client_timeout(timeout)
    deadline = time.monotonic() + timeout
    reply, page_token = pb.StatusReply(), ""
    with channel(endpoint, token=token) as ch:
        stub = pb_grpc.RotaServiceStub(ch)
        for _ in range(MAX_PAGES):
            try:
                page = stub.Status(pb.StatusRequest(group_id=group_id, page_token=page_token),
                                   timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as exc:
                raise _no_answer(from_rpc_error(exc, group_id=group_id), endpoint, timeout) from None
            reply.groups.extend(page.groups)
            reply.orchestrator, page_token = page.orchestrator, page.next_page_token
            if not page_token:
                break
    return reply
