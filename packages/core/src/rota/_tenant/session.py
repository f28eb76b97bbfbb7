"""A tenant's session: the ``Attach`` stream that keeps it alive to the orchestrator and carries commands.

:class:`SessionStream` is that part of :class:`~rota._tenant.client.Gpu` (a mixin: the state it uses,
``link``, ``_outbox``, ``_closed``, ``stats``, ..., is made by ``Gpu.__init__``): it keeps one stream
open, reconnecting (and following a new leader) until closed; sends heartbeats with the footprint and
what the last park left; and runs what the orchestrator sends: park now, restore ahead of a grant
(prefetch), yield soon, abort the job.

A park is reported once. The result of a park or restore command carries the memory it left
(host, spilled and residue bytes: ``CommandResult.memory``), and with an orchestrator that says it
reads it (``memory_once`` on its "attached" message) a heartbeat repeats no memory the session
already reported (``Heartbeat.memory_unchanged``): it carries only what changed otherwise (a park
an agent ran, a restore at a grant, a new reading of the residue). With an older orchestrator
every heartbeat carries the memory, as it expects (:class:`MemoryReports`).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator

import grpc

from rota._types import ParkPlan, ParkResult
from rota.errors import Faulted, NotLeader, from_rpc_error
from rota.residue import residue_left

log = logging.getLogger(__name__)

RECONNECT_LOG_EVERY_S = 30.0  # a session that keeps failing logs once, then a summary this often


class MemoryReports:
    """What this rank's session last reported of its memory, so that each change is reported once.

    ``once``: the orchestrator of this session reads ``CommandResult.memory`` and
    ``Heartbeat.memory_unchanged``; ``reported``: (host, spilled, residue) as last sent on this
    session (None: nothing yet); ``running``: park and restore commands whose result, with the
    memory they leave, is not queued yet (a heartbeat meanwhile says "unchanged": the result will
    report it). ``lock`` orders the three with the outbox.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.once = False
        self.reported: tuple[int, int, int] | None = None
        self.running = 0

    def new_session(self) -> None:
        with self.lock:
            self.once, self.reported = False, None


class SessionStream:
    """The session part of :class:`~rota._tenant.client.Gpu` (a mixin)."""

    def _run_session(self) -> None:
        """Keep one Attach stream open, reconnecting until closed."""
        from rota._generated import rota_v1_pb2 as pb

        failures, logged = 0, 0.0
        while not self._closed.is_set():
            self._reports.new_session()  # a new session (maybe another orchestrator) knows nothing of our memory
            hello = pb.TenantMessage(hello=pb.Hello(job_id=self.tenant, group_id=self.group, rank=self.rank,
                                                    world_size=self.world_size, pid=os.getpid(),
                                                    footprint_bytes=self.safe_footprint(),
                                                    can_prefetch=True,  # _handle runs "restore" commands
                                                    resume=self._resume))  # takes over our own live session
            try:
                for cmd in self.link.stub.Attach(self._session_messages(hello)):
                    self._handle(cmd)
                if self._closed.is_set():
                    return
            except grpc.RpcError as exc:
                if self._closed.is_set():
                    return
                err = from_rpc_error(exc, job_id=self.tenant, group_id=self.group)
                self._session_error = err
                if isinstance(err, NotLeader):
                    self.link.follow(err.leader)
                else:  # once, then a summary every RECONNECT_LOG_EVERY_S: a long outage must not flood the log
                    failures += 1
                    if failures == 1 or time.monotonic() - logged > RECONNECT_LOG_EVERY_S:
                        log.warning("rota session of %s at %s lost (%s: %s); reconnecting (%d attempts so far)",
                                    self.tenant, self.link.target, exc.code().name, err, failures)
                        logged = time.monotonic()
            time.sleep(0.2)

    def _session_messages(self, hello: object) -> Iterator[object]:
        from rota._generated import rota_v1_pb2 as pb

        yield hello
        while True:
            try:
                msg = self._outbox.get(timeout=self.heartbeat_s)
            except queue.Empty:
                heartbeat = self._heartbeat()
                if heartbeat is None:  # a message was queued meanwhile: it goes first, and shows we live
                    continue
                msg = pb.TenantMessage(heartbeat=heartbeat)
            if msg is None:  # close(): say so, so that the orchestrator does not take this rank for dead
                yield pb.TenantMessage(goodbye=pb.Goodbye())
                return
            yield msg

    def _handle(self, cmd: object) -> None:
        from rota._generated import rota_v1_pb2 as pb

        kind = cmd.WhichOneof("command")
        if kind is None:  # the orchestrator's "attached" acknowledgement
            self._session_error = None
            self._resume = cmd.resume  # shown by our next hello, should this stream break while it looks alive
            with self._reports.lock:
                self._reports.once = cmd.memory_once
            self._attached.set()
            return
        if kind == "yield_soon":
            self._yield_requested.set()
            return
        if kind == "abort":  # another rank of this job died or faulted: the job cannot go on
            self._abort(cmd.abort.reason or "no reason given")
            return
        if kind not in ("park", "restore"):
            return
        with self._reports.lock:
            self._reports.running += 1  # until its result is queued: it reports the memory the command leaves
        if kind == "restore":  # prefetch: restore while the holder still runs
            threading.Thread(target=self._prefetch, args=(cmd.command_id, cmd.restore.token),
                             name=f"rota-prefetch-{self.tenant}", daemon=True).start()
            return
        try:
            with self._state_lock:
                result = self._park_locked(ParkPlan(token=cmd.park.token))
            reply = pb.CommandResult(command_id=cmd.command_id, ok=True, bytes=result.bytes_moved,
                                     seconds=result.seconds)
        except Exception as exc:  # report every failure to the orchestrator, which faults the job
            log.exception("park of %s failed", self.tenant)
            reply = pb.CommandResult(command_id=cmd.command_id, ok=False, error=f"{type(exc).__name__}: {exc}")
        self._send_result(reply)

    def _prefetch(self, command_id: str, token: int) -> None:
        """Restore parked state before the grant (the orchestrator found room beside the
        holder), then acknowledge. Runs in its own thread so the session keeps reading."""
        from rota._generated import rota_v1_pb2 as pb

        try:
            with self._state_lock:
                result = self._restore_locked(ParkPlan(token=token)) if self.grant is None else ParkResult()
            reply = pb.CommandResult(command_id=command_id, ok=True, bytes=result.bytes_moved, seconds=result.seconds)
        except Exception as exc:  # rolled back: the state stays parked and is restored at the grant instead
            log.warning("prefetch restore of job %s rank %d in group %s failed: %s; it is retried at the grant",
                        self.tenant, self.rank, self.group, exc)
            reply = pb.CommandResult(command_id=command_id, ok=False, error=f"{type(exc).__name__}: {exc}")
        self._send_result(reply)

    def _send_result(self, reply: object) -> None:
        """Queue a park's or restore's result with the memory it left: this session reports it there."""
        from rota._generated import rota_v1_pb2 as pb

        with self._reports.lock:
            memory = self._memory(self.safe_footprint())
            reply.memory.CopyFrom(pb.Memory(host_bytes=memory[0], spilled_bytes=memory[1], residue_bytes=memory[2]))
            self._reports.reported = memory
            self._reports.running -= 1
            self._outbox.put(pb.TenantMessage(result=reply))

    def _aborted_error(self) -> Faulted:
        return Faulted(f"job {self.tenant!r} rank {self.rank} was aborted: {self.aborted}; restart every rank of "
                       "the job", job_id=self.tenant, group_id=self.group)

    def _abort(self, reason: str) -> None:
        """The orchestrator aborted this job: refuse further turns, let plugins abort collectives."""
        if self.aborted:
            return
        self.aborted = reason
        log.error("job %s rank %d in group %s aborted by the orchestrator: %s", self.tenant, self.rank, self.group,
                  reason)
        threading.Thread(target=self.pm.hook.rota_job_aborted, kwargs={"tenant": self, "reason": reason},
                         name=f"rota-abort-{self.tenant}", daemon=True).start()

    def _heartbeat(self) -> object | None:
        """Footprint, plus host memory and residue as the last park or restore left them, unless this session
        already reported them (see the module docs); None when a message was queued meanwhile."""
        from rota._generated import rota_v1_pb2 as pb

        with self._reports.lock:
            if not self._outbox.empty():
                return None
            footprint = self.safe_footprint()
            memory = self._memory(footprint)
            if self._reports.once and (self._reports.running or memory == self._reports.reported):
                return pb.Heartbeat(footprint_bytes=footprint, memory_unchanged=True)
            self._reports.reported = memory
        return pb.Heartbeat(footprint_bytes=footprint, host_bytes=memory[0], spilled_bytes=memory[1],
                            residue_bytes=memory[2])

    def _memory(self, footprint: int) -> tuple[int, int, int]:
        """(host, spilled, residue) bytes as the last park or restore left them."""
        moves = [kept[-1] for kept in (self.stats.parks, self.stats.restores) if kept]
        host = max((m.host_bytes for m in moves), default=0)
        spilled = max((m.spilled_bytes for m in moves), default=0)
        if self.parked and self.stats.parks:
            residue = residue_left(self.stats.parks[-1])
        else:  # a park that failed left the whole state on the device: the orchestrator must not count it free
            residue = footprint if self.park_failed else 0
        return host, spilled, residue


__all__ = ["RECONNECT_LOG_EVERY_S", "MemoryReports", "SessionStream"]
