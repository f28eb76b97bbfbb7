"""Tenant side of the WorkloadChannel: register a job with its node's agent and obey it.

:func:`register` hands the agent a ``Gpu``: its ``snapshot`` commands run ``gpu.park()``
(the adapters' ``rota_park`` hooks), ``restore`` the ``rota_restore`` hooks, so the
orchestrator can restore a job before its next turn, overlapped with parking the
previous holder. A tenant with no ``Gpu`` (a v1alpha1 client, an inference server)
passes its own callables to :class:`WorkloadClient`.

The channel runs on one daemon thread, reconnecting (and re-registering) until
:meth:`WorkloadClient.close`; commands run one at a time on that thread. A park's reply
carries the residue the adapters computed (also when the park failed on it), which the
agent checks against its ``--residue-max-bytes``. Before each (re)connect the client
asks the agent's pid door (:mod:`rota_agent_client.door`) for a one-time ticket and sends it
as ``rota-proof``; without a door the agent acts on none of the job's pids.

Environment:
    ROTA_AGENT        ``host:port`` (or ``unix:PATH``) of this node's agent, when not passed
    ROTA_AGENT_PROOF  path of the agent's pid door (default: ``pid.sock`` beside a
                      ``unix:DIR/agent.sock`` agent address; "" = none)
    ROTA_TOKEN        the job's token, for an agent with ``--auth-key``
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import grpc

from rota.auth import bearer, env_token
from rota.config import check_endpoint, check_id
from rota.errors import ConfigError, RotaError, from_rpc_error
from rota.types import ParkMode, ParkPlan, ParkResult
from rota.wire import snapshot_agent_pb2 as pb
from rota.wire import snapshot_agent_pb2_grpc as pb_grpc
from rota_agent_client.door import door_path, fetch
from rota_agent_client.extension import REGISTERED, attach, ext

if TYPE_CHECKING:
    from rota import Gpu

log = logging.getLogger(__name__)

__all__ = ["FATAL", "Handler", "WorkloadClient", "register", "restore_gpu"]

# (SuspendMode, tags) -> None, or a ParkResult whose residue goes back to the agent; raise on failure (an
# exception with a ``park_result`` attribute sends that result's residue too).
Handler = Callable[[int, tuple[str, ...]], "ParkResult | None"]
# Refusals that a reconnect cannot fix.
FATAL = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.PERMISSION_DENIED,
         grpc.StatusCode.UNAUTHENTICATED)


class WorkloadClient:
    """One registration of one process of a job with an agent.

    :param pid: a child process of this one to park instead (sent as ``rota-pid``; the
        agent takes it only when the door proved this process and it descends from it).
    :param proof: the agent's pid door (see :func:`door_path`); "" = do not prove the pid.
    :param token: the job's token (default ``ROTA_TOKEN``), for an agent with ``--auth-key``.
    :param app, endpoints: the inference server(s) of this job, for the ``app_endpoint``
        backend (``snapshot_agent.v1alpha1.App`` and base URLs); the agent calls no others.
    """

    def __init__(self, agent: str, job_id: str, group: str, *, on_snapshot: Handler, on_restore: Handler,
                 modes: Sequence[int] = (pb.SUSPEND_MODE_OFFLOAD,), default_mode: int = pb.SUSPEND_MODE_OFFLOAD,
                 tags: Sequence[str] = (), backend: str = "app_channel", pid: int | None = None,
                 proof: str | None = None, token: str | None = None, app: int = 0,
                 endpoints: Sequence[str] = ()) -> None:
        self.agent = check_endpoint(agent, "agent")
        self.job_id = check_id("job_id", job_id, job_id=job_id, group_id=group)
        self.group = check_id("group", group, job_id=job_id, group_id=group)
        # the agent knows its backends (plugins may add some): it refuses an unknown one, naming its choices
        check_id("backend", backend, job_id=job_id, group_id=group)
        self.caps = pb.WorkloadCapabilities(supported_modes=list(modes), default_mode=default_mode, tags=list(tags))
        self.more = ext.RegisterWorkloadExt(app=app, endpoints=list(endpoints)) if app or endpoints else None
        self.backend, self.pid = backend, pid
        self.door = door_path(self.agent, proof)
        token = env_token() if token is None else token
        self._auth = bearer(token) if token else ()
        self.on_snapshot, self.on_restore = on_snapshot, on_restore
        self.registered = threading.Event()
        self.error: RotaError | None = None
        self.commands: list[tuple[str, bool, float]] = []  # (kind, ok, seconds)
        self._closed = threading.Event()
        self._outbox: queue.Queue = queue.Queue()
        self._channel = grpc.insecure_channel(self.agent)
        self._stub = pb_grpc.SnapshotAgentServiceStub(self._channel)
        self._call: grpc.Future | None = None
        self._plain = False  # the agent sends no registration ack (not a rota agent)
        self._thread = threading.Thread(target=self._run, name=f"rota-workload-{job_id}", daemon=True)
        self._thread.start()

    def wait_registered(self, timeout: float = 30.0) -> WorkloadClient:
        """Block until the agent accepted this registration (raises the refusal, or TimeoutError).

        A rota agent says so in the channel's initial metadata (``rota-registered``); with
        an agent that does not (a plain v1alpha1 one), the job showing in its Status counts.
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.error is not None:
                raise self.error
            if self.registered.is_set():
                return self
            try:
                if self._plain and any(j.job_id == self.job_id for j in self._stub.Status(
                        pb.StatusRequest(), timeout=2.0, metadata=self._auth).job_statuses):
                    self.registered.set()
                    return self
            except grpc.RpcError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"agent {self.agent} did not list job {self.job_id!r} within {timeout:g} s; is "
                           "`rota agent serve` running there?")

    def close(self) -> None:
        self._closed.set()
        self._outbox.put(None)
        if self._call is not None:
            self._call.cancel()
        self._thread.join(5)
        self._channel.close()

    def _messages(self) -> Iterator[pb.WorkloadMessage]:
        reg = pb.RegisterWorkload(job_id=self.job_id, group=self.group, capabilities=self.caps)
        yield pb.WorkloadMessage(register=attach(reg, self.more) if self.more is not None else reg)
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            yield msg

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """This connection's metadata: backend, token, a fresh pid proof when the door answers."""
        meta = [("rota-backend", self.backend), *self._auth]
        if self.pid is not None:
            meta.append(("rota-pid", str(self.pid)))
        if self.door:
            try:
                meta.append(("rota-proof", fetch(self.door)))
            except OSError as exc:
                log.warning("job %s: no pid proof from the agent's door %s (%s); registering without one, so the "
                            "agent acts on none of this job's pids", self.job_id, self.door, exc)
        return tuple(meta)

    def _run(self) -> None:
        while not self._closed.is_set():
            try:
                self._outbox = queue.Queue()
                call = self._call = self._stub.WorkloadChannel(self._messages(), metadata=self._metadata())
                acked = any(k == REGISTERED for k, _ in call.initial_metadata() or ())  # blocks until sent
                if acked:
                    self.registered.set()
                elif not call.done():
                    self._plain = True
                for cmd in call:
                    self._outbox.put(pb.WorkloadMessage(result=self._handle(cmd)))
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                if exc.code() in FATAL:
                    log.error("agent %s refused job %s: %s", self.agent, self.job_id, exc.details())
                    self.error = from_rpc_error(exc, job_id=self.job_id, group_id=self.group)
                    return
                log.warning("workload channel of %s to %s lost (%s); reconnecting", self.job_id, self.agent,
                            exc.code())
            time.sleep(0.2)

    def _handle(self, cmd: pb.AgentCommand) -> pb.CommandResult:
        kind = cmd.WhichOneof("command")
        t0 = time.perf_counter()
        result: object = None
        try:
            if kind == "snapshot":
                result = self.on_snapshot(cmd.snapshot.mode, tuple(cmd.snapshot.tags))
            elif kind == "restore":
                self.on_restore(pb.SUSPEND_MODE_UNSPECIFIED, tuple(cmd.restore.tags))
            else:
                raise ValueError(f"unknown command {kind!r}")
            ok, error = True, ""
        except Exception as exc:  # every failure goes back to the agent, which faults the job
            log.exception("job %s: %s command failed", self.job_id, kind)
            ok, error = False, f"{type(exc).__name__}: {exc}"
            result = getattr(exc, "park_result", None)
        self.commands.append((str(kind), ok, time.perf_counter() - t0))
        reply = pb.CommandResult(command_id=cmd.command_id, ok=ok, error=error)
        residue = getattr(result, "residue", None) if kind == "snapshot" else None
        if residue:
            reply = attach(reply, ext.CommandResultExt(residue=ext.Residue(bytes=residue)))
        return reply


def restore_gpu(gpu: Gpu, plan: ParkPlan | None = None) -> ParkResult:
    """Restore ``gpu`` now, between turns, ahead of the grant, so the restore overlaps the previous
    holder's park (:meth:`rota.Gpu.restore`: never races ``acquire`` or ``park``)."""
    return gpu.restore(plan)


def _plan(mode: int, tags: tuple[str, ...]) -> ParkPlan:
    pm = ParkMode.DISCARD if mode == pb.SUSPEND_MODE_DISCARD else ParkMode.OFFLOAD
    return ParkPlan(tags=frozenset(tags), mode=pm)


def register(gpu: Gpu, agent: str | None = None, *, tags: Sequence[str] = (), backend: str = "app_channel",
             token: str | None = None) -> WorkloadClient:
    """Register ``gpu``'s job with the node's agent; its commands run ``gpu``'s park/restore hooks.

    :param agent: ``host:port`` or ``unix:PATH``; default ``ROTA_AGENT``.
    :param backend: ``app_channel`` (adapters park regions) or ``cuda`` (the agent
        checkpoints this whole process, proven through its pid door; the hooks are not used).
    :param token: the job's token for an agent with ``--auth-key`` (default ``ROTA_TOKEN``).
    """
    where = "agent"
    if agent is None:
        agent, where = os.environ.get("ROTA_AGENT", ""), "ROTA_AGENT"
    if not agent:
        raise ConfigError(f"no agent address for job {gpu.tenant!r}: set ROTA_AGENT=host:port (the node's "
                          "`rota agent serve`) or pass agent=")
    check_endpoint(agent, where)
    client = WorkloadClient(agent, gpu.tenant, gpu.group,
                            on_snapshot=lambda mode, t: gpu.park(_plan(mode, t)),
                            on_restore=lambda mode, t: restore_gpu(gpu, _plan(mode, t)),
                            modes=(pb.SUSPEND_MODE_OFFLOAD, pb.SUSPEND_MODE_DISCARD), tags=tags, backend=backend,
                            token=token)
    return client
