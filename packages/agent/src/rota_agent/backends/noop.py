"""``noop``: a backend that moves nothing — for tests and for jobs with nothing to park.

Reachable only through a WorkloadChannel registration carrying metadata
``rota-backend: noop`` (never through the wire's BackendConfig oneof). ``delay_s``
lets tests hold an operation open; ``fail`` makes every step fail.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from rota_agent.backends._base import Job, Moved
from rota_agent.errors import BackendFailed, UnknownJob


class NoopBackend:
    name: ClassVar[str] = "noop"
    whole_process: ClassVar[bool] = False

    def __init__(self, delay_s: float = 0.0, fail: str = "") -> None:
        self.delay_s, self.fail = delay_s, fail
        self.calls: list[tuple[str, str]] = []

    def parse(self, job: Job | None, job_id: str, config: Any) -> None:
        if job is None:
            raise UnknownJob(f"job {job_id!r} is not registered with this agent; the noop backend needs a "
                             "registration", job_id=job_id)

    async def _step(self, kind: str, job: Job) -> Moved:
        self.calls.append((kind, job.job_id))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail:
            raise BackendFailed(f"noop {kind} of job {job.job_id!r} failed on purpose: {self.fail}",
                                job_id=job.job_id)
        return Moved(0, 0)

    async def snapshot(self, job: Job, config: Any) -> Moved:
        return await self._step("snapshot", job)

    async def restore(self, job: Job, config: Any) -> Moved:
        return await self._step("restore", job)
