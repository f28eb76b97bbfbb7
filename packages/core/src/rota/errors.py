"""rota's error tree, and its one mapping to and from gRPC status codes.

Every error names the job and group it concerns and says what to do next. Errors are
*permanent* (fix the input or the setup) or *transient* (retry after ``delay`` seconds);
callers branch on that, not on message text. ``to_status``/``from_rpc_error`` are the
only places that translate between these classes and gRPC, on both sides of the wire.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

__all__ = [
    "ConfigError",
    "Faulted",
    "InvalidArgument",
    "NotFound",
    "NotHolder",
    "NotLeader",
    "PermanentError",
    "RotaError",
    "StaleToken",
    "TransientError",
    "Unavailable",
    "UnsupportedVersion",
    "from_rpc_error",
]


class _Status:
    """A class attribute that is the ``grpc.StatusCode`` of that name, importing grpc on first use:
    the CLI and plugins import these errors without loading grpc (``rota --help`` starts faster)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> grpc.StatusCode:
        import grpc

        return getattr(grpc.StatusCode, self.name)


class RotaError(Exception):
    """Base of every error rota raises to users."""

    code: Any = _Status("UNKNOWN")

    def __init__(self, message: str, *, job_id: str = "", group_id: str = "") -> None:
        super().__init__(message)
        self.job_id = job_id
        self.group_id = group_id

    def trailers(self) -> tuple[tuple[str, str], ...]:
        """gRPC trailing metadata that carries this error's extra fields (servers send it)."""
        return ()


class PermanentError(RotaError):
    """Retrying the same call will fail the same way."""


class TransientError(RotaError):
    """The call may succeed if retried after ``delay`` seconds."""

    def __init__(self, message: str, *, delay: float = 1.0, **kw: str) -> None:
        super().__init__(message, **kw)
        self.delay = delay


class InvalidArgument(PermanentError):
    """An id, flag, env var or field is malformed."""

    code = _Status("INVALID_ARGUMENT")


class ConfigError(InvalidArgument):
    """A ROTA_* environment variable or config file value is bad."""


class NotFound(PermanentError):
    """The group does not exist and the orchestrator does not create groups."""

    code = _Status("NOT_FOUND")


class Unauthenticated(PermanentError):
    """The caller brought no valid credential (missing, malformed, expired, wrongly signed)."""

    code = _Status("UNAUTHENTICATED")


class PermissionDenied(PermanentError):
    """The caller's credential does not cover what it asked to do."""

    code = _Status("PERMISSION_DENIED")


class NotHolder(PermanentError):
    """Release or park by a job that does not hold the group."""

    code = _Status("PERMISSION_DENIED")


class StaleToken(PermanentError):
    """A fencing token older than the group's current grant."""

    code = _Status("FAILED_PRECONDITION")


class Unavailable(TransientError):
    """The orchestrator (or its store) cannot answer now; never a grant."""

    code = _Status("UNAVAILABLE")


class NotLeader(Unavailable):
    """This orchestrator replica does not lead; ``leader`` is where to retry ("" = none yet).

    Travels as UNAVAILABLE with the trailing metadata ``rota-leader: HOST:PORT``, so
    v1alpha1 clients see a plain retryable error and rota clients follow the leader.
    """

    def __init__(self, message: str, *, leader: str = "", **kw: str) -> None:
        super().__init__(message, delay=0.2, **kw)
        self.leader = leader

    def trailers(self) -> tuple[tuple[str, str], ...]:
        return (("rota-leader", self.leader),) if self.leader else ()


class DeadlineExceeded(TransientError):
    """The call's deadline passed before it could be answered (an Acquire left the queue)."""

    code = _Status("DEADLINE_EXCEEDED")


class AlreadyAttached(PermanentError):
    """A rank of the job already has a live session from another process."""

    code = _Status("ALREADY_EXISTS")


class Faulted(TransientError):
    """The job's state is faulted (a park or restore failed); retry re-runs it."""

    code = _Status("UNAVAILABLE")


class UnsupportedVersion(PermanentError, ImportError):
    """An optional dependency is not installed, or its version is outside the range a rota package supports.

    Raised by :mod:`rota.compat`. ``str()`` names the version found, the supported range and
    the fix; ``dist``, ``found`` (None when not installed), ``spec`` and ``fix`` carry them. It
    is an ImportError too, so ``except ImportError`` around an optional import catches it.
    """

    def __init__(self, message: str, *, dist: str, found: str | None, spec: str, fix: str) -> None:
        super().__init__(message)
        self.dist, self.found, self.spec, self.fix = dist, found, spec, fix


_BY_CODE: dict[str, type[RotaError]] = {  # grpc.StatusCode names
    "INVALID_ARGUMENT": InvalidArgument,
    "NOT_FOUND": NotFound,
    "PERMISSION_DENIED": NotHolder,  # what a release of a turn not held answers
    "UNAUTHENTICATED": Unauthenticated,
    "ALREADY_EXISTS": AlreadyAttached,
    "FAILED_PRECONDITION": StaleToken,
    "UNAVAILABLE": Unavailable,
    "DEADLINE_EXCEEDED": DeadlineExceeded,
}


def from_rpc_error(err: grpc.RpcError, *, job_id: str = "", group_id: str = "") -> RotaError:
    """Turn a gRPC error from an orchestrator or agent into the matching RotaError."""
    import grpc

    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    detail = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNAVAILABLE:
        trailers = dict(err.trailing_metadata() or ()) if hasattr(err, "trailing_metadata") else {}
        if "rota-leader" in trailers:
            return NotLeader(detail, leader=str(trailers["rota-leader"]), job_id=job_id, group_id=group_id)
    cls = _BY_CODE.get(getattr(code, "name", ""), RotaError)
    return cls(detail or str(code), job_id=job_id, group_id=group_id)
