"""The snapshot agent: job records, asynchronous operations, and the gRPC servicer.

One agent runs per node (``rota agent serve``). Tenant processes register over
``WorkloadChannel``; the orchestrator (or any v1alpha1 client) calls ``Snapshot`` /
``Restore``, which validate the request and the backend config *inside the RPC*
(bad input never creates an operation) and return an operation id at once; the work
runs as an asyncio task under a deadline, and ``GetOperation`` reports it.

Job states (``JobState``): IDLE (registered, nothing parked) → TRANSITIONING (an
operation runs) → SAVED (parked) → TRANSITIONING → RUNNING (restored). Any failure or
missed deadline → FAULTED with the cause kept; FAULTED is retryable by a new Snapshot.
A job has at most one operation in flight: a second one is ABORTED (``Busy``).

Verified release: after every successful snapshot the agent measures what the job
still holds on the device (:mod:`rota_agent._residue`: the residue the tenant's
adapters report over the WorkloadChannel, and NVML per-process bytes of its pids, the
latter counted for whole-process backends). Over ``residue_max_bytes``
(``--residue-max-bytes`` / ``ROTA_RESIDUE_MAX_BYTES``, default 256 MiB, 0 = off) the
operation is FAILED and the job FAULTED with a message naming the pids and bytes
(NVML) and the tags/tensors (adapters); its state stays parked, so a retried Snapshot
re-measures and, once within the limit, completes. The report travels in rota-owned
fields of GetOperationResponse and JobStatus (``GetOperationResponseExt``,
``JobStatusExt``: v1alpha1 peers ignore them), with the fault cause in JobStatusExt.

Rollback: a step that fails was rolled back by the tenant or backend (outgoing stays
resident, incoming stays parked); a step that misses the deadline is undone by the
backend's ``rollback`` once it finishes (``app_channel`` queues the opposite command).
Either way the job is FAULTED with the cause, and FAULTED is retried by a new Snapshot
on the same agent.

Concurrency and lock order. All job, channel and operation state is touched only on
the agent's one event loop, by code that does not await between checking and changing
it (``start`` is synchronous); so the loop needs no lock and takes none. The locks
that do exist, in the one order they may nest (outer first):

1. *the event loop* (implicit): never blocks on a thread lock; blocking work (NVML,
   CUDA driver calls) goes to executor threads and is awaited.
2. ``rota.nvml._lock`` (``threading.Lock``): taken in executor threads around the
   one-time ``nvmlInit``; a leaf: nothing is taken while it is held and it is never
   taken on the loop.
3. tenant side, on the WorkloadClient thread of a process (``rota_agent.client``):
   ``Gpu._state_lock`` (core, by ``gpu.park`` / :func:`~rota_agent.client.restore_gpu`)
   then the adapters' own locks (e.g. ``TensorParker._lock``) inside the hooks, the
   same order as core's ``acquire``. The client holds no lock while it talks to the agent.

No asyncio.Lock is used. A closing WorkloadChannel fails its pending commands at
once, so a tenant that dies mid-park faults its job immediately rather than at the deadline.

Error codes: unknown job / operation → NOT_FOUND; malformed ids or backend config →
INVALID_ARGUMENT; direct_memory / memory_regions and platform limits → UNIMPLEMENTED;
another operation in flight → ABORTED; restoring a FAULTED job → FAILED_PRECONDITION.
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
from rota._generated import snapshot_agent_pb2 as pb
from rota._generated import snapshot_agent_pb2_grpc as pb_grpc
from rota._grpc_server import rpc_errors
from rota._ids import check_id
from rota.errors import InvalidArgument, RotaError
from rota_agent import _residue
from rota_agent._generated import agent_ext_pb2 as ext
from rota_agent.backends import Backend, Channel, Job, default_backends
from rota_agent.errors import (
    BackendFailed,
    BadBackendConfig,
    Busy,
    UnknownJob,
    UnknownOperation,
    Unsupported,
    WrongState,
)

log = logging.getLogger(__name__)

KEEP_OPERATIONS = 4096  # finished operations remembered for GetOperation
NVML_TIMEOUT_S = 30.0  # one per-process NVML read after a park
_CONFIG_BACKENDS = {"cuda": "cuda", "app_endpoint": "app_endpoint", "app_channel": "app_channel"}


@dataclass(eq=False)
class Operation:
    op_id: str
    job_id: str
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
                 process_bytes: _residue.ProcessReader = _nvml.process_bytes_by_pid) -> None:
        """``residue_max_bytes``: None reads ``ROTA_RESIDUE_MAX_BYTES``; ``process_bytes``: the NVML
        per-pid reader (tests inject a fake, as no GPU is there)."""
        if op_timeout_s <= 0:
            raise InvalidArgument(f"op_timeout_s={op_timeout_s!r} must be > 0 seconds")
        self.residue_max_bytes = _residue.residue_max(residue_max_bytes)
        self.process_bytes = process_bytes
        self.backends = backends if backends is not None else default_backends()
        self.op_timeout_s = op_timeout_s
        self.name = name
        self.accelerators = accelerators
        self.jobs: dict[str, Job] = {}
        self.ops: collections.OrderedDict[str, Operation] = collections.OrderedDict()
        self._tasks: set[asyncio.Task] = set()

    # -------------------------------------------------------- registration

    def register(self, msg: pb.RegisterWorkload, pid: int, backend: str) -> tuple[Job, Channel]:
        check_id("job_id", msg.job_id, job_id=msg.job_id, group_id=msg.group)
        check_id("group", msg.group, job_id=msg.job_id, group_id=msg.group)
        caps = msg.capabilities
        valid = {pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD}
        for m in [*caps.supported_modes, *([caps.default_mode] if caps.default_mode else [])]:
            if m not in valid:
                raise InvalidArgument(f"job {msg.job_id!r} registered mode {m}, which is not SUSPEND_MODE_OFFLOAD "
                                      "(1) or SUSPEND_MODE_DISCARD (2)", job_id=msg.job_id)
        if caps.supported_modes and caps.default_mode and caps.default_mode not in caps.supported_modes:
            raise InvalidArgument(f"job {msg.job_id!r}: default_mode {caps.default_mode} is not among its "
                                  f"supported_modes {list(caps.supported_modes)}", job_id=msg.job_id)
        if backend not in self.backends or backend == "app_endpoint":
            choices = ", ".join(sorted(set(self.backends) - {"app_endpoint"}))
            raise BadBackendConfig(f"job {msg.job_id!r} asked for backend {backend!r} (metadata rota-backend); "
                                   f"choose one of {choices}", job_id=msg.job_id)
        job = self.jobs.get(msg.job_id)
        if job is not None and job.group and job.group != msg.group:
            raise InvalidArgument(f"job {msg.job_id!r} is registered in group {job.group!r}, not {msg.group!r}; "
                                  "one job id belongs to one group", job_id=msg.job_id, group_id=msg.group)
        if job is None:
            job = self.jobs[msg.job_id] = Job(msg.job_id, msg.group)
        job.capabilities.CopyFrom(caps)
        job.default_backend = backend
        ch = Channel(pid=pid)
        job.channels.append(ch)
        log.info("job %s (group %s) registered: pid %d, backend %s", job.job_id, job.group, pid, backend)
        return job, ch

    def unregister(self, job: Job, ch: Channel, why: str) -> None:
        ch.closed = True
        ch.fail_pending(f"the WorkloadChannel of job {job.job_id!r} (pid {ch.pid}) closed mid-command: {why}")
        if ch in job.channels:
            job.channels.remove(ch)
        if not job.channels and job.op is None and job.state != pb.JOB_STATE_FAULTED \
                and job.default_backend != "cuda" and self.jobs.get(job.job_id) is job:
            del self.jobs[job.job_id]  # gone, nothing to report; FAULTED jobs stay visible
        log.info("job %s: channel of pid %d closed (%s)", job.job_id, ch.pid, why)

    # ----------------------------------------------------------- operations

    def start(self, kind: str, req: pb.SnapshotRequest | pb.RestoreRequest) -> Operation:
        job_id = req.job_id
        check_id("job_id", job_id, job_id=job_id, group_id=req.group)
        if req.group:
            check_id("group", req.group, job_id=job_id, group_id=req.group)
        job = self.jobs.get(job_id)
        if job is not None and req.group and job.group and job.group != req.group:
            raise InvalidArgument(f"job {job_id!r} is in group {job.group!r} on this agent, not {req.group!r}",
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
        if job is None:  # an explicit target (cuda pids, server endpoints): known from now on
            job = self.jobs[job_id] = Job(job_id, req.group, default_backend=name)
        op = Operation(uuid.uuid4().hex, job_id, kind, name, time.monotonic())
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
            raise UnknownJob(f"job {job_id!r} is not registered with agent {self.name} (registered: "
                             f"{', '.join(sorted(self.jobs)) or 'none'}) and the request has no backend_config "
                             "naming a target; register the job's WorkloadChannel first", job_id=job_id)
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
        op.status, op.error = pb.OPERATION_STATUS_FAILED, error
        job.state, job.fault = pb.JOB_STATE_FAULTED, error
        log.error("job %s FAULTED: %s", job.job_id, error)

    def operation(self, op_id: str) -> Operation:
        if not op_id:
            raise InvalidArgument("operation_id is empty; pass the id Snapshot or Restore returned")
        op = self.ops.get(op_id)
        if op is None:
            raise UnknownOperation(f"operation {op_id!r} is unknown to agent {self.name} (never issued, or "
                                   "forgotten after a restart or after the last 4096 operations)")
        return op

    async def stop(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for job in self.jobs.values():
            for ch in job.channels:
                ch.outbox.put_nowait(None)


_PARKED = object()  # marker: restore with the config the job was parked with


class AgentService(pb_grpc.SnapshotAgentServiceServicer):
    """snapshot_agent.v1alpha1.SnapshotAgentService over an :class:`Agent`."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    @rpc_errors
    async def Snapshot(self, request: pb.SnapshotRequest, context: Any) -> pb.SnapshotResponse:
        return pb.SnapshotResponse(operation_id=self.agent.start("snapshot", request).op_id)

    @rpc_errors
    async def Restore(self, request: pb.RestoreRequest, context: Any) -> pb.RestoreResponse:
        return pb.RestoreResponse(operation_id=self.agent.start("restore", request).op_id)

    @rpc_errors
    async def GetOperation(self, request: pb.GetOperationRequest, context: Any) -> pb.GetOperationResponse:
        op = self.agent.operation(request.operation_id)
        resp = pb.GetOperationResponse(status=op.status, elapsed_ms=op.elapsed_ms())
        if op.storage_bytes is not None:
            resp.storage_bytes = op.storage_bytes
        if op.device_bytes is not None:
            resp.snapshot_device_bytes = op.device_bytes
        if op.error:
            resp.error = op.error
        if op.residue is not None:
            resp = _residue.attach(resp, ext.GetOperationResponseExt(residue=op.residue.to_pb()))
        return resp

    @rpc_errors
    async def Status(self, request: pb.StatusRequest, context: Any) -> pb.StatusResponse:
        jobs = [_job_status(j) for j in sorted(self.agent.jobs.values(), key=lambda j: j.job_id)]
        loop = asyncio.get_running_loop()
        accel = await loop.run_in_executor(None, self.agent.accelerators)
        return pb.StatusResponse(job_statuses=jobs, accelerator_statuses=[
            pb.AcceleratorStatus(id=i, memory_used_bytes=u, memory_total_bytes=t) for i, u, t in accel])

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
        meta = {k: v for k, v in (context.invocation_metadata() or ())}
        try:
            pid = _meta_pid(meta.get("rota-pid", "0"))
            job, ch = self.agent.register(first.register, pid, str(meta.get("rota-backend") or "app_channel"))
        except RotaError as exc:
            await context.abort(exc.code, str(exc))
        reader = asyncio.create_task(self._read(ch, request_iterator))
        why = "stream closed by the workload"
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
        finally:
            reader.cancel()
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
    return _residue.attach(st, more)


def _meta_pid(raw: str) -> int:
    try:
        pid = int(raw)
    except ValueError:
        raise InvalidArgument(f"metadata rota-pid={raw!r} is not a process id; send the tenant's os.getpid()") \
            from None
    if pid < 0:
        raise InvalidArgument(f"metadata rota-pid={raw!r} is negative; send the tenant's os.getpid()")
    return pid


__all__ = ["Agent", "AgentService", "BackendFailed", "Operation"]
