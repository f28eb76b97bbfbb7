"""Errors of the snapshot agent, each with the gRPC status code it travels as.

They extend :mod:`rota.errors` so one ``except RotaError`` catches both sides; the
agent's servicer aborts RPCs with ``exc.code`` and ``str(exc)``.
"""

from __future__ import annotations

import grpc

from rota.errors import InvalidArgument, NotFound, PermanentError, TransientError

__all__ = ["BackendFailed", "BadBackendConfig", "BadProof", "Busy", "InUse", "TooMany", "UnknownJob",
           "UnknownOperation", "Unsupported", "WrongState"]


class UnknownJob(NotFound):
    """The job is not registered with this agent and the request names no explicit target."""


class UnknownOperation(NotFound):
    """GetOperation for an id this agent never issued (or forgot after a restart)."""


class BadBackendConfig(InvalidArgument):
    """A BackendConfig (or a registration's backend metadata) is malformed."""


class Busy(TransientError):
    """The job already has a Snapshot or Restore in flight; retry when it finishes."""

    code = grpc.StatusCode.ABORTED


class WrongState(PermanentError):
    """The job is in a state that does not allow the request (e.g. restoring a FAULTED job)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class Unsupported(PermanentError):
    """The backend or platform cannot do this (non-x86-64, NCCL, old driver, direct_memory...)."""

    code = grpc.StatusCode.UNIMPLEMENTED


class BackendFailed(PermanentError):
    """A backend step failed or missed its deadline; the job is FAULTED."""

    code = grpc.StatusCode.INTERNAL


class TooMany(TransientError):
    """The agent holds as many jobs (or a job as many channels) as it may; retry once some have ended."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class InUse(TransientError):
    """An anonymous job id already has an open channel; retry once it closed (a reconnect)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class BadProof(TransientError):
    """A ``rota-proof`` ticket the pid door never issued, already used, or expired; fetch a new one."""

    code = grpc.StatusCode.ABORTED
