"""``app_channel``: region-level parking by the tenant's own adapter, over its WorkloadChannel.

The agent sends an ``AgentCommand`` (snapshot or restore) down every open channel of
the job (one per rank) and waits for each ``CommandResult``. In the tenant,
:class:`rota_agent_client.WorkloadClient` runs the adapters' ``rota_park`` /
``rota_restore`` hooks (e.g. rota_fsdp's pinned-pool copies) and replies. A channel
that closes while a command is pending (the process died) fails the step at once.

Each park reply may carry the residue the tenant's adapters computed (rota-owned
``CommandResultExt`` fields, see :mod:`rota_agent_client.extension`); the ranks' residues are
summed into :attr:`Moved.residue`, also on a failed park (``BackendFailed.residue``).

Rollback: a tenant whose park or restore *fails* has rolled it back itself (the
adapters' contract: a failed park frees nothing, a failed restore stays parked). A
step that misses the agent's deadline is still running in the tenant; :meth:`rollback`
queues the opposite command behind it (commands run one at a time per process), so
once it finishes the outgoing job is resident again, or the incoming one parked again.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, ClassVar

from rota.config import shown
from rota.wire import snapshot_agent_pb2 as pb
from rota_agent import _residue
from rota_agent.backends._base import Channel, Job, Moved
from rota_agent.errors import BackendFailed, BadBackendConfig, UnknownJob, WrongState
from rota_agent_client.extension import ext, read

MAX_ERROR_CHARS = 300  # of one tenant's error text, kept on one line
_MODES = {pb.SUSPEND_MODE_UNSPECIFIED, pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD}


def check_mode(mode: int, caps: pb.WorkloadCapabilities, where: str) -> int:
    """Resolve UNSPECIFIED to the workload's default (else OFFLOAD) and check support."""
    if mode not in _MODES:
        raise BadBackendConfig(f"{where}: mode {mode} is not a SuspendMode; use SUSPEND_MODE_OFFLOAD (1) or "
                               "SUSPEND_MODE_DISCARD (2)")
    if mode == pb.SUSPEND_MODE_UNSPECIFIED:
        mode = caps.default_mode or pb.SUSPEND_MODE_OFFLOAD
    if caps.supported_modes and mode not in caps.supported_modes:
        names = ", ".join(pb.SuspendMode.Name(m) for m in caps.supported_modes)
        raise BadBackendConfig(f"{where}: mode {pb.SuspendMode.Name(mode)} is not supported by the workload "
                               f"(it registered {names}); ask for one of those")
    return mode


def check_tags(tags: Any, caps: pb.WorkloadCapabilities, where: str) -> tuple[str, ...]:
    out = tuple(tags)
    for t in out:
        if not t or not t.strip():
            raise BadBackendConfig(f"{where}: an empty tag in tags; omit tags to mean every tag")
        if caps.tags and t not in caps.tags:
            raise BadBackendConfig(f"{where}: tag {shown(t)} is not one the workload registered "
                                   f"({', '.join(caps.tags)}); use one of those or omit tags")
    return out


class AppChannelBackend:
    name: ClassVar[str] = "app_channel"
    whole_process: ClassVar[bool] = False

    def parse(self, job: Job | None, job_id: str, config: pb.AppChannelConfig | None) -> tuple[int, tuple[str, ...]]:
        if job is None:
            raise UnknownJob(f"job {job_id!r} is not registered with this agent: the app_channel backend needs the "
                             "job's WorkloadChannel (call rota_agent.register(gpu) in the tenant)", job_id=job_id)
        config = config or pb.AppChannelConfig()
        where = f"app_channel config of job {job_id!r}"
        mode = check_mode(config.mode, job.capabilities, where)
        tags = check_tags(config.tags, job.capabilities, where)
        return mode, tags

    async def _send(self, job: Job, make: Any, kind: str, config: tuple[int, tuple[str, ...]]) -> Moved:
        channels = [c for c in job.channels if not c.closed]
        if not channels:
            raise WrongState(f"job {job.job_id!r} has no open WorkloadChannel (its process exited?); "
                             "restart the tenant or use another backend", job_id=job.job_id)
        loop = asyncio.get_running_loop()
        futs = []
        for ch in channels:
            cid = uuid.uuid4().hex
            fut = ch.pending[cid] = loop.create_future()
            futs.append(fut)
            ch.outbox.put_nowait(make(cid))
        try:
            results = await asyncio.gather(*futs)
        finally:
            for ch in channels:
                for cid in [k for k, f in ch.pending.items() if f.done() or f in futs]:
                    ch.pending.pop(cid, None)
        residue = _residue.merge([dict(read(r, ext.CommandResultExt).residue.bytes) for r in results])
        errors = [" ".join(r.error[:MAX_ERROR_CHARS].split()) or "failed without a message"
                  for r in results if not r.ok]
        if errors:  # ranks that did move are moved back: the job as a whole stays where it was
            self._undo(job, config, kind, [ch for ch, r in zip(channels, results, strict=True) if r.ok])
            exc = BackendFailed(f"{kind} of job {job.job_id!r} over its WorkloadChannel failed: "
                                + "; ".join(errors), job_id=job.job_id)
            exc.residue = residue  # type: ignore[attr-defined]
            raise exc
        return Moved(residue=residue)

    def rollback(self, job: Job, config: tuple[int, tuple[str, ...]], kind: str) -> None:
        """Queue the opposite of a ``kind`` step that missed its deadline; nobody waits for its result."""
        self._undo(job, config, kind, job.channels)

    @staticmethod
    def _undo(job: Job, config: tuple[int, tuple[str, ...]], kind: str, channels: list[Channel]) -> None:
        mode, tags = config
        for ch in channels:
            if ch.closed:
                continue
            cid = f"rollback-{uuid.uuid4().hex}"
            ch.outbox.put_nowait(pb.AgentCommand(command_id=cid, restore=pb.RestoreCommand(tags=tags))
                                 if kind == "snapshot" else
                                 pb.AgentCommand(command_id=cid, snapshot=pb.SnapshotCommand(mode=mode, tags=tags)))

    async def snapshot(self, job: Job, config: tuple[int, tuple[str, ...]]) -> Moved:
        mode, tags = config
        return await self._send(job, lambda cid: pb.AgentCommand(
            command_id=cid, snapshot=pb.SnapshotCommand(mode=mode, tags=tags)), "snapshot", config)

    async def restore(self, job: Job, config: tuple[int, tuple[str, ...]]) -> Moved:
        _, tags = config
        return await self._send(job, lambda cid: pb.AgentCommand(
            command_id=cid, restore=pb.RestoreCommand(tags=tags)), "restore", config)
