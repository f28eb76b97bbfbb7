"""The orchestrator, for plugins that run or extend it: core's own, its config, group state and services.

What a server needs of an orchestrator is :class:`OrchestratorProtocol`: the gRPC
servicers (:func:`running_orchestrator`, ``rota orchestrator serve``) call only its
methods. :class:`Orchestrator` is core's own; a plugin may answer the
``rota_orchestrator`` hook with another object of this protocol (rota_etcd's HA
replica, which builds an :class:`Orchestrator` over its own :class:`GroupStore` for
each term it leads).

Health: the server creates one grpc.health.v1 servicer with every name of
:data:`SERVICE_NAMES` and :data:`LEADER_HEALTH` SERVING and hands it to
:meth:`OrchestratorProtocol.report_health_to` before :meth:`~OrchestratorProtocol.start`.
Core's own leaves it as it is (it always answers and always leads); a replica sets the
services NOT_SERVING while no leader is known and :data:`LEADER_HEALTH` NOT_SERVING
while it follows.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from rota._orchestrator.config import OrchestratorConfig
from rota._orchestrator.inproc import running_orchestrator
from rota._orchestrator.service import LEADER_HEALTH, SERVICE_NAMES
from rota._orchestrator.sessions import Session
from rota._orchestrator.state import GroupState
from rota._orchestrator.store import GroupStore, MemoryStore
from rota._orchestrator.turns import Orchestrator

if TYPE_CHECKING:
    from grpc_health.v1.health import aio

    from rota.types import Grant, ReleaseInfo, TurnRequest

__all__ = ["LEADER_HEALTH", "SERVICE_NAMES", "GroupState", "GroupStore", "MemoryStore", "Orchestrator",
           "OrchestratorConfig", "OrchestratorProtocol", "Session", "running_orchestrator"]


class OrchestratorProtocol(Protocol):
    """What rota's servers and CLI call on an orchestrator (:class:`Orchestrator` is one).

    Every method may raise :class:`rota.errors.RotaError`; the servicers map it to its
    gRPC status (a replica that does not lead raises :class:`rota.errors.NotLeader`).
    """

    config: OrchestratorConfig
    stopped: asyncio.Event  # set to stop serving (SIGINT/SIGTERM); the server then calls stop()

    @property
    def name(self) -> str:
        """Shown in Status replies (e.g. ``embedded@unix:/run/rota.sock``)."""

    @property
    def groups(self) -> dict[str, GroupState]:
        """The groups this orchestrator grants turns of now (read by /metrics at scrape time)."""

    @property
    def leading(self) -> bool:
        """True while it grants turns (always, for core's own; only as leader, for a replica)."""

    def report_health_to(self, health: aio.HealthServicer) -> None:
        """Keep ``health`` (grpc.health.v1, all names SERVING) true; called once, before :meth:`start`."""

    def report_metrics_to(self, metrics: Any) -> None:
        """Feed grant and park events to ``metrics`` (``rota orchestrator serve --metrics-listen``)."""

    async def start(self) -> None:
        """Load state and start background work; called once before the server starts."""

    async def stop(self) -> None:
        """Fail blocked acquires with UNAVAILABLE and stop background work."""

    async def acquire(self, req: TurnRequest) -> Grant:
        """Wait until ``req.job_id`` holds ``req.group_id``; the grant carries its fencing token."""

    async def release(self, job_id: str, group_id: str, token: int = 0, rank: int = 0, *,
                      footprint_bytes: int = 0, restore_seconds: float = 0.0) -> ReleaseInfo:
        """End the turn (``token`` 0: a v1alpha1 Yield, which carries none); ``restore_seconds``: the rank's
        restore at the turn's start, for the restore histogram."""

    async def abandon(self, job_id: str, group_id: str, token: int) -> None:
        """A grant its caller never received (the call was cancelled): hand it on."""

    async def evict(self, job_id: str, group_id: str, *, reason: str, lost: bool = False) -> tuple[bool, bool]:
        """End the job's turn or take it out of the queue; returns (was_holder, was_queued)."""

    async def status(self, group_id: str = "") -> list[GroupState]:
        """One group (NotFound if unknown) or all of them, sorted by id."""

    async def agent_job_states(self, group_id: str) -> list[tuple[str, str, str]]:
        """(agent, JobState name, job) for the jobs of ``group_id`` that node agents know; [] without agents."""

    async def attach(self, job_id: str, group_id: str, rank: int, pid: int, footprint_bytes: int, *,
                     can_prefetch: bool = False, world_size: int = 1) -> Session:
        """Open a tenant session (the Attach stream); its commands arrive on ``Session.outbox``."""

    def heartbeat(self, s: Session, footprint_bytes: int, memory: tuple[int, int, int] | None = None) -> None:
        """The session lives; ``memory``: host, spilled and residue bytes (None: unchanged). Also called with a
        park's or restore's result (its memory, when the client sent it), just before :meth:`command_result`."""

    def command_result(self, command_id: str, ok: bool, error: str, nbytes: int, seconds: float) -> None:
        """A tenant's answer to a park or restore command."""

    async def fault_rank(self, s: Session, reason: str) -> None:
        """The session's rank failed: the job's turn ends and its other ranks are told to abort."""

    async def detach(self, s: Session, why: str, *, clean: bool = False) -> None:
        """The session ended (``clean``: the tenant said goodbye)."""
