"""``app_channel``: region-level parking by the tenant's own adapter, over its WorkloadChannel.

The agent sends an ``AgentCommand`` (snapshot or restore) down every open channel of
the job (one per rank) and waits for each ``CommandResult``. In the tenant,
:class:`rota_agent.client.WorkloadClient` runs the adapters' ``rota_park`` /
``rota_restore`` hooks (e.g. rota_fsdp's pinned-pool copies) and replies. A channel
that closes while a command is pending (the process died) fails the step at once.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any, ClassVar

from rota._generated import snapshot_agent_pb2 as pb
from rota_agent.backends._base import Job, Moved
from rota_agent.errors import BackendFailed, BadBackendConfig, UnknownJob, WrongState

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
            raise BadBackendConfig(f"{where}: empty tag in tags={list(out)!r}; omit tags to mean every tag")
        if caps.tags and t not in caps.tags:
            raise BadBackendConfig(f"{where}: tag {t!r} is not one the workload registered "
                                   f"({', '.join(caps.tags)}); use one of those or omit tags")
    return out


class AppChannelBackend:
    name: ClassVar[str] = "app_channel"

    def parse(self, job: Job | None, job_id: str, config: pb.AppChannelConfig | None) -> tuple[int, tuple[str, ...]]:
        if job is None:
            raise UnknownJob(f"job {job_id!r} is not registered with this agent: the app_channel backend needs the "
                             "job's WorkloadChannel (call rota_agent.register(gpu) in the tenant)", job_id=job_id)
        config = config or pb.AppChannelConfig()
        where = f"app_channel config of job {job_id!r}"
        mode = check_mode(config.mode, job.capabilities, where)
        tags = check_tags(config.tags, job.capabilities, where)
        return mode, tags

    async def _send(self, job: Job, make: Any, kind: str) -> Moved:
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
        errors = [r.error or "failed without a message" for r in results if not r.ok]
        if errors:
            raise BackendFailed(f"{kind} of job {job.job_id!r} over its WorkloadChannel failed: "
                                + "; ".join(errors), job_id=job.job_id)
        return Moved()

    async def snapshot(self, job: Job, config: tuple[int, tuple[str, ...]]) -> Moved:
        mode, tags = config
        return await self._send(job, lambda cid: pb.AgentCommand(
            command_id=cid, snapshot=pb.SnapshotCommand(mode=mode, tags=tags)), "snapshot")

    async def restore(self, job: Job, config: tuple[int, tuple[str, ...]]) -> Moved:
        _, tags = config
        return await self._send(job, lambda cid: pb.AgentCommand(
            command_id=cid, restore=pb.RestoreCommand(tags=tags)), "restore")
