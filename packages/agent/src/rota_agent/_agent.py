"""The snapshot agent: job records, asynchronous operations, and the gRPC servicer.

One agent runs per node (``rota agent serve``). Tenant processes register over
``WorkloadChannel``; the orchestrator (or any v1alpha1 client) calls ``Snapshot`` /
``Restore``, which validate the request and the backend config *inside the RPC*
(bad input never creates an operation) and return an operation id at once; the work
runs as an asyncio task under a deadline, and ``GetOperation`` reports it. Job states,
error codes, who may do what and the bounds are in the package README.

After every successful snapshot the agent measures what the job still holds on the
device (:mod:`rota_agent._residue`); over ``residue_max_bytes`` the operation FAILS and
the job is FAULTED while staying parked, so a retried Snapshot re-measures. A step
that misses the deadline is undone by the backend's ``rollback`` once it finishes.

Concurrency and lock order. All job, channel and operation state is touched only on
the agent's one event loop, by code that does not await between checking and changing
it (``start`` is synchronous); so the loop needs no lock and takes none. The locks
that do exist, in the one order they may nest (outer first):

1. *the event loop* (implicit): never blocks on a thread lock; blocking work (NVML,
   CUDA driver calls) goes to executor threads and is awaited.
2. ``rota.nvml._lock`` (``threading.Lock``): taken in executor threads around the
   one-time ``nvmlInit``; a leaf: nothing is taken while it is held and it is never
   taken on the loop.
3. tenant side, on the WorkloadClient thread of a process (``rota_agent_client``):
   the client's state lock (core, by ``gpu.park`` / ``gpu.restore``)
   then the adapters' own locks (e.g. ``TensorParker.lock``) inside the hooks, the
   same order as core's ``acquire``. The client holds no lock while it talks to the agent.

No asyncio.Lock is used. A closing WorkloadChannel fails its pending commands at
once, so a tenant that dies mid-park faults its job immediately rather than at the deadline.

Who may do what: every RPC has a caller (:class:`rota.auth.Principal`: with
``--auth-key`` the token's, else everyone is admin); a registration belongs to an
*owner* (:attr:`Caller.owner`), and a job's channels all come from its owner. Pids come
only from the pid door (:mod:`rota_agent._door`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from rota import nvml as _nvml
from rota.auth import Principal, ServerAuth
from rota.config import check_id, shown
from rota.errors import InvalidArgument, PermissionDenied, RotaError
from rota.rpc import rpc_errors
from rota.wire import snapshot_agent_pb2 as pb
from rota.wire import snapshot_agent_pb2_grpc as pb_grpc
from rota_agent import _residue
from rota_agent._door import Door
from rota_agent._registration import ANONYMOUS, Caller, Registration, prove, vet
from rota_agent.backends import Backend, Channel, Job, default_backends
from rota_agent.errors import (
    BackendFailed,
    BadBackendConfig,
    BadProof,
    Busy,
    InUse,
    TooMany,
    UnknownJob,
    UnknownOperation,
    Unsupported,
    WrongState,
)
from rota_agent_client.extension import REGISTERED, attach, ext, read

log = logging.getLogger(__name__)

KEEP_OPERATIONS = 4096  # finished operations remembered for GetOperation
NVML_TIMEOUT_S = 30.0  # one per-process NVML read after a park
MAX_JOBS = 1024  # jobs one agent knows at once
MAX_JOBS_PER_OWNER = 256  # ... of which one owner may register
MAX_CHANNELS_PER_JOB = 64  # processes (ranks) of one job on this node
MAX_FAULT_CHARS = 1000  # an operation's error / a job's fault, kept on one line
STATUS_DETAIL_BYTES = 1 << 20  # rota-owned details (fault, residue) in one Status reply; ids and states always fit
KEEP_CLOSED_S = 300.0  # a job whose channels all closed stays visible (its fault, its parked state) this long
_CONFIG_BACKENDS = {"cuda": "cuda", "app_endpoint": "app_endpoint", "app_channel": "app_channel"}


def clip(text: str, limit: int = MAX_FAULT_CHARS) -> str:
    """``text`` on one line and at most ``limit`` characters: it goes into Status replies and logs."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else f"{flat[:limit - 20]}... ({len(flat)} chars)"


@dataclass(eq=False)
class Operation:
    op_id: str
    job_id: str
    group: str
    kind: str  # snapshot | restore
    backend: str
    started: float
    status: int = pb.OPERATION_STATUS_PENDING
    finished: float = 0.0
    storage_bytes: int | None = None
    device_bytes: int | None = None
    error: str = ""
    residue: _residue.Residue | None = None  # snapshot: what stayed on the device

    def elapsed_ms(self) -> int:
        end = self.finished or time.monotonic()
        return int((end - self.started) * 1000)


class Agent:
    """Jobs, channels and operations of one node. Not thread-safe: use from its loop."""

    def __init__(self, backends: dict[str, Backend] | None = None, *, op_timeout_s: float = 300.0,
                 name: str = "agent", accelerators: Callable[[], list[tuple[str, int, int]]] = _nvml.accelerators,
                 residue_max_bytes: int | None = None,
                 process_bytes: _residue.ProcessReader = _nvml.process_bytes_by_pid,
                 keep_closed_s: float = KEEP_CLOSED_S) -> None:
        """``residue_max_bytes``: None reads ``ROTA_RESIDUE_MAX_BYTES``; ``process_bytes``: the NVML
        per-pid reader (tests inject a fake, as no GPU is there); ``keep_closed_s``: how long a job
        whose channels all closed stays listed."""
        if op_timeout_s <= 0:
            raise InvalidArgument(f"op_timeout_s={op_timeout_s!r} must be > 0 seconds")
        if not keep_closed_s >= 0:
            raise InvalidArgument(f"keep_closed_s={keep_closed_s!r} must be >= 0 seconds")
        self.keep_closed_s = keep_closed_s
        self.door = Door()
        self.residue_max_bytes = _residue.residue_max(residue_max_bytes)
        self.process_bytes = process_bytes
        self.backends = backends if backends is not None else default_backends()
        self.op_timeout_s = op_timeout_s
        self.name = name
        self.accelerators = accelerators
        self.jobs: dict[str, Job] = {}
        self.metrics: Any = None  # rota_agent._metrics.AgentMetrics, when served (--metrics-listen)
        self.ops: collections.OrderedDict[str, Operation] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    # -------------------------------------------------------- registration

    def admit(self, reg: Registration) -> tuple[Job, Channel]:
        """Add a vetted and proven channel (:func:`~rota_agent._registration.vet`, then
        :func:`~rota_agent._registration.prove`, off the loop) to its job, creating the job or joining its owner's:
        on the event loop, where the agent's state changes."""
        job_id, group, backend = reg.job_id, reg.group, reg.backend
        self.sweep()
        job = self._job_for(job_id, group, reg.caller, backend)
        if len(job.channels) >= MAX_CHANNELS_PER_JOB:
            raise TooMany(f"job {job_id!r} already has {len(job.channels)} open WorkloadChannels on this agent "
                          f"(at most {MAX_CHANNELS_PER_JOB}); close some first", job_id=job_id)
        job.capabilities.CopyFrom(reg.capabilities)
        job.default_backend = backend
        if reg.endpoints:
            job.app, job.endpoints = reg.app, reg.endpoints
        ch = Channel(pid=reg.pid, start=reg.start)
        job.channels.append(ch)
        job.closed_at = 0.0
        self.jobs[job_id] = job
        log.info("job %s (group %s) registered by %s: pid %s, backend %s", job_id, group, job.owner,
                 reg.pid or "not proven", backend)
        return job, ch

    def _job_for(self, job_id: str, group: str, caller: Caller, backend: str) -> Job:
        """The record a new channel joins: the job's own (same owner), or a new one."""
        job = self.jobs.get(job_id)
        owner = caller.owner
        if job is not None:
            if job.group != group:
                raise InvalidArgument(f"job {job_id!r} is registered with this agent in another group than "
                                      f"{group!r}; one job id belongs to one group", job_id=job_id, group_id=group)
            same = caller.keyed or (owner == job.owner and (owner != ANONYMOUS or not job.live))
            if not same:
                if job.live and owner == job.owner:  # both anonymous: the old channel may be on its way out
                    raise InUse(f"job {job_id!r} already has an open WorkloadChannel on this agent and neither "
                                "proved who it is; retry once it closed, or register through the pid door or with "
                                "the job's token so its owner is known", job_id=job_id, group_id=group)
                if job.live or job.owner != ANONYMOUS:
                    raise PermissionDenied(f"job {job_id!r} is registered with this agent by another owner; a "
                                           "job's channels must all come from its owner (the same uid through the "
                                           "pid door, or the job's token when the agent has --auth-key)",
                                           job_id=job_id, group_id=group)
                job = None  # an anonymous record nobody holds any more: a proven owner starts afresh
            elif job.live and backend != job.default_backend:
                raise InvalidArgument(f"job {job_id!r} is registered with backend {job.default_backend}; every "
                                      f"channel of a job uses one backend, not {backend}", job_id=job_id)
        if job is None:
            if len(self.jobs) >= MAX_JOBS:
                raise TooMany(f"this agent already knows {len(self.jobs)} jobs (at most {MAX_JOBS}); retry once "
                              "some have ended", job_id=job_id)
            if sum(1 for j in self.jobs.values() if j.owner == owner) >= MAX_JOBS_PER_OWNER:
                raise TooMany(f"{owner} already registered {MAX_JOBS_PER_OWNER} jobs with this agent; end some "
                              "first", job_id=job_id)
            job = Job(job_id, group, owner=owner)
        return job

    def unregister(self, job: Job, ch: Channel, why: str) -> None:
        ch.closed = True
        ch.fail_pending(f"the WorkloadChannel of job {job.job_id!r} (pid {ch.pid}) closed mid-command: {why}")
        if ch in job.channels:
            job.channels.remove(ch)
        if not job.live:
            job.closed_at = time.monotonic()
        if not job.channels and job.op is None and job.state != pb.JOB_STATE_FAULTED \
                and job.default_backend != "cuda" and self.jobs.get(job.job_id) is job:
            del self.jobs[job.job_id]  # gone, nothing to report; FAULTED jobs stay visible
        log.info("job %s: channel of pid %d closed (%s)", job.job_id, ch.pid, clip(why, 200))

    def sweep(self) -> None:
        """Forget jobs whose channels all closed more than ``keep_closed_s`` ago (nothing in flight)."""
        now = time.monotonic()
        for job_id, job in list(self.jobs.items()):
            if job.op is None and not job.live and job.closed_at and now - job.closed_at >= self.keep_closed_s:
                del self.jobs[job_id]
                log.info("job %s forgotten: no channel for %.0f s", job_id, now - job.closed_at)

    # ----------------------------------------------------------- operations

    def start(self, kind: str, req: pb.SnapshotRequest | pb.RestoreRequest, caller: Principal) -> Operation:
        job_id = req.job_id
        check_id("job_id", job_id, job_id=job_id, group_id=req.group)
        if req.group:
            check_id("group", req.group, job_id=job_id, group_id=req.group)
        self.sweep()
        job = self.jobs.get(job_id)
        if not caller.may_act_for(req.group or (job.group if job is not None else caller.group), job_id):
            raise PermissionDenied(f"{caller.subject} may not {kind} job {job_id!r}; use a token issued for that job "
                                   "or the orchestrator's (admin)", job_id=job_id, group_id=req.group)
        if job is not None and req.group and job.group != req.group:
            raise InvalidArgument(f"job {job_id!r} is not registered in group {req.group!r} on this agent",
                                  job_id=job_id, group_id=req.group)
        if job is not None and job.op is not None:
            raise Busy(f"job {job_id!r} already has {job.op.kind} operation {job.op.op_id} in flight; poll "
                       "GetOperation until it finishes, then retry", job_id=job_id, group_id=req.group)
        if kind == "restore" and job is not None and job.state == pb.JOB_STATE_FAULTED:
            raise WrongState(f"job {job_id!r} is FAULTED ({job.fault}); its parked state cannot be trusted: "
                             "snapshot it again (retry) or restart the tenant", job_id=job_id, group_id=req.group)
        name, config = self._backend_of(kind, job, job_id, req)
        backend = self.backends[name]
        parsed = backend.parse(job, job_id, config) if not (kind == "restore" and config is _PARKED) \
            else job.parked_with[1]  # type: ignore[union-attr]
        if job is None:  # every backend refuses an unregistered job in parse; this keeps it that way
            raise UnknownJob(f"job {job_id!r} is not registered with this agent", job_id=job_id)
        op = Operation(uuid.uuid4().hex, job_id, job.group, kind, name, time.monotonic())
        self.ops[op.op_id] = op
        while len(self.ops) > KEEP_OPERATIONS:
            self.ops.popitem(last=False)
        if (kind == "snapshot" and job.state == pb.JOB_STATE_SAVED) or (
                kind == "restore" and job.state in (pb.JOB_STATE_IDLE, pb.JOB_STATE_RUNNING)):
            op.status, op.finished = pb.OPERATION_STATUS_COMPLETE, op.started  # already there: idempotent
            return op
        job.op = op
        prev = job.state
        job.state = pb.JOB_STATE_TRANSITIONING
        task = asyncio.get_running_loop().create_task(self._run(job, op, backend, parsed, prev))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return op

    def _backend_of(self, kind: str, job: Job | None, job_id: str, req: Any) -> tuple[str, Any]:
        which = req.backend_config.WhichOneof("backend") if req.HasField("backend_config") else None
        if which in ("direct_memory", "memory_regions"):
            raise Unsupported(f"backend {which} is not implemented by rota-agent (job {job_id!r}); use cuda, "
                              "app_channel or app_endpoint", job_id=job_id)
        if which is not None:
            return _CONFIG_BACKENDS[which], getattr(req.backend_config, which)
        if req.backend == pb.BACKEND_CUDA:
            return "cuda", None
        if req.backend != pb.BACKEND_UNSPECIFIED:
            raise BadBackendConfig(f"backend={req.backend} is not a Backend value (job {job_id!r}); use "
                                   "backend_config instead", job_id=job_id)
        if job is None:
            raise UnknownJob(f"job {job_id!r} is not registered with agent {self.name}; register the job's "
                             "WorkloadChannel first", job_id=job_id)
        if kind == "restore" and job.parked_with is not None:
            return job.parked_with[0], _PARKED  # restore the way it was parked
        return job.default_backend, None

    async def _run(self, job: Job, op: Operation, backend: Backend, parsed: Any, prev: int) -> None:
        step = backend.snapshot if op.kind == "snapshot" else backend.restore
        try:
            moved = await asyncio.wait_for(step(job, parsed), self.op_timeout_s)
        except asyncio.TimeoutError:
            undo = getattr(backend, "rollback", None)
            if undo is not None:
                undo(job, parsed, op.kind)
            self._fail(job, op, f"{op.kind} of job {job.job_id!r} ({op.backend}) missed its "
                                f"{self.op_timeout_s:g} s deadline"
                                + ("; rolled back: the opposite command is queued behind it, so the job ends "
                                   f"{'resident' if op.kind == 'snapshot' else 'parked'} once the step finishes"
                                   if undo is not None else ""))
        except asyncio.CancelledError:
            self._fail(job, op, "agent shutting down")
            raise
        except RotaError as exc:
            reported = getattr(exc, "residue", None)
            if op.kind == "snapshot" and reported:
                op.residue = job.residue = _residue.measure(job.job_id, op.backend, reported, None,
                                                            count_nvml=False, limit=self.residue_max_bytes)
            self._fail(job, op, str(exc))
        except Exception as exc:  # a backend bug must fault the job, not kill the agent
            log.exception("backend %s crashed", op.backend)
            self._fail(job, op, f"{type(exc).__name__}: {exc}")
        else:
            op.storage_bytes, op.device_bytes = moved.storage_bytes, moved.device_bytes
            if op.kind == "snapshot":
                job.parked_with = (op.backend, parsed)  # parked, even if too much stayed behind
                op.residue = job.residue = await self._measure(job, op, backend, moved)
                if op.residue.fault:
                    self._fail(job, op, op.residue.fault)
                    return
            op.status = pb.OPERATION_STATUS_COMPLETE
            job.state = pb.JOB_STATE_SAVED if op.kind == "snapshot" else pb.JOB_STATE_RUNNING
            job.fault = ""
            log.info("job %s: %s via %s done in %d ms", job.job_id, op.kind, op.backend, op.elapsed_ms())
        finally:
            op.finished = time.monotonic()
            job.op = None
            if self.metrics is not None:
                self.metrics.finished(op.kind, op.backend, op.status == pb.OPERATION_STATUS_COMPLETE,
                                      op.finished - op.started, op.device_bytes)
            if not job.channels and job.state != pb.JOB_STATE_FAULTED and job.default_backend == "app_channel" \
                    and self.jobs.get(job.job_id) is job:
                del self.jobs[job.job_id]

    async def _measure(self, job: Job, op: Operation, backend: Backend, moved: Any) -> _residue.Residue:
        """What the parked job still holds: its adapters' report, and NVML for its pids (off the loop)."""
        pids = moved.pids or job.pids
        nvml = None
        if pids:
            try:
                nvml = await asyncio.wait_for(
                    asyncio.get_running_loop().run_in_executor(None, self.process_bytes, pids), NVML_TIMEOUT_S)
            except Exception as exc:  # a stuck or broken reader leaves the adapters' report to judge by
                log.warning("job %s: NVML per-process read failed (%s); residue from adapters only", job.job_id,
                            exc or type(exc).__name__)
        return _residue.measure(job.job_id, op.backend, moved.residue, nvml,
                                count_nvml=bool(getattr(backend, "whole_process", False)),
                                limit=self.residue_max_bytes)

    def _fail(self, job: Job, op: Operation, error: str) -> None:
        error = clip(error)
        op.status, op.error = pb.OPERATION_STATUS_FAILED, error
        job.state, job.fault = pb.JOB_STATE_FAULTED, error
        log.error("job %s FAULTED: %s", job.job_id, error)

    def operation(self, op_id: str, caller: Principal) -> Operation:
        if not op_id:
            raise InvalidArgument("operation_id is empty; pass the id Snapshot or Restore returned")
        op = self.ops.get(op_id)
        if op is None:
            raise UnknownOperation(f"operation {shown(op_id)} is unknown to agent {self.name} (never issued, or "
                                   "forgotten after a restart or after the last 4096 operations)")
        if not caller.may_act_for(op.group, op.job_id):
            raise PermissionDenied(f"{caller.subject} may not read operation {op_id} of job {op.job_id!r}")
        return op

    def visible(self, caller: Principal) -> list[Job]:
        """The jobs ``caller`` may see, by id (after forgetting the long-closed ones)."""
        self.sweep()
        return [j for j in sorted(self.jobs.values(), key=lambda j: j.job_id) if caller.may_act_for(j.group, j.job_id)]

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self.jobs.values():
            for ch in job.channels:
                ch.outbox.put_nowait(None)


_PARKED = object()  # marker: restore with the config the job was parked with


class AgentService(pb_grpc.SnapshotAgentServiceServicer):
    """snapshot_agent.v1alpha1.SnapshotAgentService over an :class:`Agent`.

    ``auth`` decides who each caller is (:class:`rota.auth.ServerAuth`): with a key,
    every call needs a token, on TCP and on the Unix socket alike; without one
    (``ServerAuth(insecure=True)``), every caller is admin.
    """

    ACCELERATORS_TIMEOUT_S = 1.0  # Status answers without accelerators rather than wait on a stuck NVML

    def __init__(self, agent: Agent, auth: ServerAuth | None = None) -> None:
        self.agent = agent
        self.auth = auth or ServerAuth(insecure=True)

    def _caller(self, context: Any) -> Principal:
        return self.auth.principal(context.invocation_metadata())

    @rpc_errors
    async def Snapshot(self, request: pb.SnapshotRequest, context: Any) -> pb.SnapshotResponse:
        return pb.SnapshotResponse(operation_id=self.agent.start("snapshot", request, self._caller(context)).op_id)

    @rpc_errors
    async def Restore(self, request: pb.RestoreRequest, context: Any) -> pb.RestoreResponse:
        return pb.RestoreResponse(operation_id=self.agent.start("restore", request, self._caller(context)).op_id)

    @rpc_errors
    async def GetOperation(self, request: pb.GetOperationRequest, context: Any) -> pb.GetOperationResponse:
        op = self.agent.operation(request.operation_id, self._caller(context))
        resp = pb.GetOperationResponse(status=op.status, elapsed_ms=op.elapsed_ms())
        if op.storage_bytes is not None:
            resp.storage_bytes = op.storage_bytes
        if op.device_bytes is not None:
            resp.snapshot_device_bytes = op.device_bytes
        if op.error:
            resp.error = op.error
        if op.residue is not None:
            resp = attach(resp, ext.GetOperationResponseExt(residue=op.residue.to_pb()))
        return resp

    @rpc_errors
    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        """Every visible job's id and state; rota-owned details while they fit ``STATUS_DETAIL_BYTES``."""
        budget = STATUS_DETAIL_BYTES
        jobs = []
        for job in self.agent.visible(self._caller(context)):
            st = _job_status(job)
            if job.residue is not None or job.fault:
                size = st.ByteSize()
                if size > budget:
                    st = pb.JobStatus(job_id=job.job_id, state=job.state)
                else:
                    budget -= size
            jobs.append(st)
        loop = asyncio.get_running_loop()
        try:
            accel = await asyncio.wait_for(loop.run_in_executor(None, self.agent.accelerators),
                                           self.ACCELERATORS_TIMEOUT_S)
        except asyncio.TimeoutError:
            log.warning("NVML did not answer within %g s; Status lists no accelerators", self.ACCELERATORS_TIMEOUT_S)
            accel = []
        return pb.StatusResponse(job_statuses=jobs, accelerator_statuses=[
            pb.AcceleratorStatus(id=i, memory_used_bytes=u, memory_total_bytes=t) for i, u, t in accel])

    async def _register(self, msg: pb.RegisterWorkload, context: Any) -> tuple[Job, Channel]:
        metadata = tuple(context.invocation_metadata() or ())
        meta = {k: v for k, v in metadata if isinstance(v, str)}
        principal = self.auth.principal(metadata)
        proof = None
        if "rota-proof" in meta:
            proof = self.agent.door.redeem(meta["rota-proof"][:128])
            if proof is None:
                raise BadProof(f"job {shown(msg.job_id)}: the rota-proof ticket is unknown, used or expired (or its "
                               "process exited); fetch a new one from the pid door and register again")
        backend = meta.get("rota-backend") or "app_channel"
        caller = Caller(principal, keyed=self.auth.key is not None, proof=proof)
        reg = vet(msg, caller, backend[:64], self.agent.backends, pid_claim=_meta_pid(meta.get("rota-pid", "0")),
                  more=read(msg, ext.RegisterWorkloadExt))
        reg = await asyncio.to_thread(prove, reg)  # /proc reads: the loop keeps serving meanwhile
        return self.agent.admit(reg)

    async def WorkloadChannel(self, request_iterator: AsyncIterator[pb.WorkloadMessage],
                              context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AgentCommand]:
        """First message register; then commands go out and results come back."""
        try:
            first = await request_iterator.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("message") != "register":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first WorkloadChannel message must be "
                                f"register, got {first.WhichOneof('message')!r}")
        try:
            job, ch = await self._register(first.register, context)
        except RotaError as exc:
            await context.abort(exc.code, str(exc))
        try:
            await context.send_initial_metadata(((REGISTERED, "1"),))  # tells the client it was accepted
        except Exception:
            self.agent.unregister(job, ch, "the workload left before its registration was acknowledged")
            raise
        reader = asyncio.create_task(self._read(ch, request_iterator))
        why = "stream closed by the workload"
        getter: asyncio.Task | None = None
        try:
            while True:
                getter = asyncio.create_task(ch.outbox.get())
                done, _ = await asyncio.wait({getter, reader}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    exc = reader.exception() if not reader.cancelled() else None
                    if exc is not None:
                        why = f"stream broke: {exc}"
                    break
                cmd = getter.result()
                if cmd is None:
                    why = "agent stopping"
                    break
                yield cmd
        finally:  # the stream may end at any await or yield: neither task outlives it
            reader.cancel()
            if getter is not None:
                getter.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader
            self.agent.unregister(job, ch, why)

    async def _read(self, ch: Channel, it: AsyncIterator[pb.WorkloadMessage]) -> None:
        async for msg in it:
            if msg.WhichOneof("message") != "result":
                log.warning("ignoring a second register on an open WorkloadChannel (pid %d)", ch.pid)
                continue
            fut = ch.pending.pop(msg.result.command_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.result)


def _job_status(job: Job) -> pb.JobStatus:
    """JobStatus, with the rota-owned residue/fault fields when there is something to say."""
    st = pb.JobStatus(job_id=job.job_id, state=job.state)
    if job.residue is None and not job.fault:
        return st
    more = ext.JobStatusExt(fault=job.fault)
    if job.residue is not None:
        more.residue.CopyFrom(job.residue.to_pb())
    return attach(st, more)


def _meta_pid(raw: str) -> int:
    try:
        pid = int(raw) if len(raw) <= 20 else -1
    except ValueError:
        pid = -1
    if pid < 0:
        raise InvalidArgument(f"metadata rota-pid={shown(raw)} is not a process id; send the pid of the process "
                              "to park (this process or a child of it), or nothing")
    return pid


__all__ = ["Agent", "AgentService", "BackendFailed", "Caller", "Operation"]
