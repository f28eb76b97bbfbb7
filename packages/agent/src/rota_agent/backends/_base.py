"""The park-backend interface, and the per-job records every backend works on.

A backend turns one Snapshot or Restore into real work: forwarding a command down the
job's WorkloadChannel (``app_channel``), checkpointing its processes through the CUDA
driver (``cuda``), calling an inference server's sleep/wake API (``app_endpoint``) or
nothing at all (``noop``, for tests). The agent (:mod:`rota_agent._agent`) owns job
states, operations and deadlines; a backend only validates its config and does the
move, raising :class:`rota_agent.errors.RotaError` subclasses with clear messages.

``parse`` runs inside the RPC, so a bad config is refused with INVALID_ARGUMENT before
any operation starts; ``snapshot``/``restore`` run in the operation's task.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from rota.wire import snapshot_agent_pb2 as pb
from rota_agent.errors import BadBackendConfig

MAX_TAGS, MAX_TAG_CHARS = 32, 64  # tags of one registration or one request


def check_tag_names(tags: Any, what: str, job_id: str) -> tuple[str, ...]:
    """``tags`` if they are at most ``MAX_TAGS`` non-empty printable names of at most ``MAX_TAG_CHARS`` characters."""
    out = tuple(tags)
    if len(out) > MAX_TAGS or any(not t.strip() or len(t) > MAX_TAG_CHARS or not t.isprintable() for t in out):
        raise BadBackendConfig(f"{what} must be at most {MAX_TAGS} non-empty printable names of at most "
                               f"{MAX_TAG_CHARS} characters", job_id=job_id)
    return out


@dataclass
class Moved:
    """What one backend step moved (None = the backend cannot tell).

    ``residue``: device bytes the tenant's adapters report left behind after a park,
    by tag or category (``app_channel``); ``pids``: the processes the step moved, when
    they are not the job's registered ones (``cuda`` explicit targets), for the
    agent's NVML residue check.
    """

    storage_bytes: int | None = None
    device_bytes: int | None = None
    residue: dict[str, int] = field(default_factory=dict)
    pids: tuple[int, ...] = ()


@dataclass(eq=False)
class Channel:
    """One open WorkloadChannel of a job (one rank/process).

    ``pid``/``start``: the process this channel proved it is (through the agent's pid
    door, see :mod:`rota_agent._door`) and its start time; 0 when it proved nothing, and
    then no backend acts on a pid of it.
    """

    pid: int = 0
    start: int = 0
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    pending: dict[str, asyncio.Future] = field(default_factory=dict)
    closed: bool = False

    def fail_pending(self, why: str) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_result(pb.CommandResult(ok=False, error=why))
        self.pending.clear()


@dataclass(eq=False)
class Job:
    """Everything this agent knows about one job."""

    job_id: str
    group: str = ""
    state: int = pb.JOB_STATE_IDLE
    channels: list[Channel] = field(default_factory=list)
    capabilities: pb.WorkloadCapabilities = field(default_factory=pb.WorkloadCapabilities)
    default_backend: str = "app_channel"  # used when a request carries no BackendConfig
    op: Any = None  # the Operation in flight, if any
    fault: str = ""
    parked_with: tuple[str, Any] | None = None  # (backend, parsed config) of the last good snapshot
    residue: Any = None  # rota_agent._residue.Residue of the last snapshot (measured or reported)
    owner: str = ""  # who registered it (a credential, a proven uid, or "anonymous"); see rota_agent._agent
    app: int = 0  # app_endpoint: the registered App (vLLM, SGLang) ...
    endpoints: tuple[str, ...] = ()  # ... and base URLs, the only ones the agent will call for this job
    closed_at: float = 0.0  # time.monotonic() when its last channel closed (0 while one is open)

    @property
    def pids(self) -> tuple[int, ...]:
        """The proven pids of the job's open channels."""
        return tuple(sorted({c.pid for c in self.channels if c.pid and not c.closed}))

    @property
    def proven(self) -> dict[int, int]:
        """pid -> start time of the job's open channels that proved their process."""
        return {c.pid: c.start for c in self.channels if c.pid and not c.closed}

    @property
    def live(self) -> bool:
        return any(not c.closed for c in self.channels)


class Backend(Protocol):
    """One way of moving a job's device state out and back."""

    name: ClassVar[str]
    whole_process: ClassVar[bool]  # a park releases the whole process's device memory (context too)

    def parse(self, job: Job | None, job_id: str, config: Any) -> Any:
        """Validate ``config`` (the oneof's message, or None) for ``job``; return what
        :meth:`snapshot`/:meth:`restore` need. ``job`` is None when the job is not
        registered: raise :class:`rota_agent.errors.UnknownJob`, since a backend acts only
        on what a registered job proved is its own (its pids, its endpoints), never on a
        target the request alone names."""

    async def snapshot(self, job: Job, config: Any) -> Moved:
        """Move the job's device state out. Raise on failure (the job becomes FAULTED)."""

    async def restore(self, job: Job, config: Any) -> Moved:
        """Bring it back. Raise on failure (the job becomes FAULTED)."""

    # Optional: ``def rollback(self, job: Job, config: Any, kind: str) -> None`` -- called
    # (on the loop, must not block) when a ``kind`` step missed the agent's deadline, to
    # undo it once it finishes after all; see AppChannelBackend.rollback.
