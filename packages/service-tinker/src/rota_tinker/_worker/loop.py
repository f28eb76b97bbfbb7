"""A worker's loop: units in arrival order, device units inside turns (see :mod:`rota_tinker._worker.main`).

:class:`Loop` runs a trainer's or a sampler's units; the batched LoRA worker runs its passes in
:class:`rota_tinker._worker.passes.BatchLoop`, a subclass. A turn is the tenant's own rota turn
(:class:`OwnTurn`) or its base's shared LoRA turn (:class:`rota_tinker._worker.shared_turn.SharedTurn`): both
have ``begin``, ``may_continue``, ``queued`` and ``end``.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections import deque
from multiprocessing.connection import Connection
from typing import Any

from rota_tinker._worker.common import UserError

log = logging.getLogger("rota_tinker.worker")

__all__ = ["Loop", "OwnTurn", "ParkFault", "Stop", "WorkUnit", "failed_reply", "resolve_failed_park"]

WorkUnit = tuple[str, str, dict[str, Any], dict[str, float]]  # request id, op, its arguments, its timing


class Stop(Exception):
    """The HTTP process asked this worker to exit (or went away)."""


class ParkFault(Exception):
    """The tenant's last park left more on the device than ``ROTA_RESIDUE_MAX_BYTES``, and freeing did not help."""


def resolve_failed_park(gpu: Any) -> None:
    """Before a turn: if the tenant's last park left too much on the device, free what this process can (garbage,
    the allocator's cache) and measure again. While it stays, the tenant takes no turn on the device.

    :raises ParkFault: naming what is still on the device (the unit fails with it).
    """
    from rota.residue import residue_fault, residue_max_bytes

    if not (gpu.parked and residue_fault(gpu.last_park, residue_max_bytes())):
        return
    import torch

    gc.collect()
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()
    fault = gpu.recheck_park()
    if fault:
        raise ParkFault(f"this tenant's last park did not free the device, so it takes no turn until it does: "
                        f"{fault}")
    log.warning("tenant %s: what its last park left was freed; it takes turns again", gpu.tenant)


class OwnTurn:
    """The tenant's own rota turn (``<tenant>.trainer`` / ``.sampler``): acquire, restore, release."""

    def __init__(self, loop: Loop) -> None:
        self.loop, self.gpu = loop, loop.gpu

    def begin(self) -> dict[str, float]:
        resolve_failed_park(self.gpu)
        self.gpu.acquire()  # the working set's rota_turn_started restarts the allocator's peak
        return {"new_turn": 1.0, **self.loop.events()}

    def may_continue(self) -> bool:
        return not self.gpu.should_yield

    def queued(self) -> dict[str, float]:
        """What a unit that joins the turn records (parks of this tenant since its previous unit)."""
        return {"wait_s": 0.0, "restore_s": 0.0, **self.loop.events(parks_only=True)}

    def end(self) -> None:
        if self.loop.working is not None:
            self.loop.working.turn_ended()
        self.gpu.release()


class Loop:
    """Runs units in arrival order; device units in turns, queued units of this tenant sharing one."""

    def __init__(self, worker: Any, gpu: Any, conn: Connection, units_per_turn: int,
                 working: Any = None) -> None:
        """``working``: the tenant's :class:`rota_torch.WorkingSet` on CUDA (None elsewhere)."""
        self.worker, self.gpu, self.conn, self.units_per_turn = worker, gpu, conn, max(1, units_per_turn)
        self.working = working
        self.seen = 0  # gpu.stats.events already attributed to a unit (a running total)
        self.parks_seen = 0  # gpu.stats.parks likewise
        self.pending: deque[WorkUnit] = deque()  # received while a turn of another kind ran: next in line
        self.own = OwnTurn(self) if gpu is not None else None

    def run(self) -> None:
        try:
            while True:
                self._unit(self.pending.popleft() if self.pending else self.recv())
        except Stop:
            return

    def recv(self) -> WorkUnit:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise Stop from None
        if msg is None:
            raise Stop
        rid, op, args = msg
        return rid, op, args, {"recv": time.monotonic()}

    def _turn_of(self, unit: WorkUnit) -> Any:
        """The turn ``unit`` runs in: its base's shared LoRA turn, the tenant's own, or None (no device needed)."""
        if self.own is None:  # a base holder: nothing it runs takes a turn
            return None
        shared = self.worker.shared_turn_of(unit[1], unit[2])
        if shared is not None:
            return shared
        return self.own if self.worker.needs_turn(unit[1], unit[2]) else None

    def _unit(self, msg: WorkUnit) -> None:
        """One unit; a device unit takes a turn and runs whatever is queued behind it in the same turn."""
        rid, op, args, timing = msg
        turn = self._turn_of(msg)
        if turn is None:
            self.reply(rid, self.call(op, args, timing), timing)
            return
        t0 = time.monotonic()
        try:
            started = turn.begin()
        except Exception as e:  # the orchestrator is gone or the restore failed: this unit fails, the next retries
            log.error("%s: could not get a turn: %s", op, e)
            timing["acquire_s"] = time.monotonic() - t0
            self.reply(rid, ("err", f"could not get a turn on the device: {type(e).__name__}: {e}", "server"),
                        timing)
            return
        timing.update(acquire_s=time.monotonic() - t0, **started)
        queue, ran, stop = [msg], 0, False  # units received for this turn and not run yet, in arrival order
        while queue:
            batched = queue[0][1] in self.worker.BATCHED_OPS
            if batched and not stop:  # the units queued behind it may join its batch
                stop = self._take_queued(queue, self.units_per_turn - ran, turn)
            n = next((i for i, unit in enumerate(queue) if unit[1] != queue[0][1]), len(queue)) if batched else 1
            batch, queue = queue[:n], queue[n:]
            outcomes = self._run(batch)
            ran += len(batch)
            if not queue and not stop and ran < self.units_per_turn:
                stop = self._take_queued(queue, 1, turn)
            if not queue:
                self.end_turn(turn, batch[-1][3])
            for (rid, _, _, timing), outcome in zip(batch, outcomes, strict=True):
                self.reply(rid, outcome, timing)
        if stop:
            raise Stop

    def _take_queued(self, queue: list[WorkUnit], limit: int, turn: Any) -> bool:
        """Receive units already waiting in the pipe into ``queue`` (up to ``limit`` units in it), while the turn
        may go on; a unit of another turn waits in ``pending`` and ends the taking. True if the HTTP process
        asked this worker to stop meanwhile."""
        while len(queue) < limit and not self.pending and turn.may_continue() and self.conn.poll(0):
            try:
                unit = self.recv()
            except Stop:
                return True
            if self._turn_of(unit) not in (turn, None):
                self.pending.append(unit)
                break
            unit[3].update(acquire_s=0.0, new_turn=0.0, **turn.queued())
            queue.append(unit)
        return False

    def end_turn(self, turn: Any, timing: dict[str, float]) -> None:
        t0 = time.monotonic()
        try:
            turn.end()
        except Exception as e:  # the lease expires on the orchestrator's side; the next acquire starts afresh
            log.error("release failed: %s", e)
        timing["release_s"] = time.monotonic() - t0

    def events(self, parks_only: bool = False) -> dict[str, float]:
        """This tenant's rota events since the last unit: grant wait, restores, parks (seconds; bytes parked; on
        CUDA the process's NVML bytes around the last park, see :data:`rota_tinker._http.handles.PARK_READINGS`)."""
        events, self.seen = self.gpu.stats.events.since(self.seen)
        parks, self.parks_seen = self.gpu.stats.parks.since(self.parks_seen)
        out = {"parked_s": sum(e - s for kind, s, e in events if kind == "park"),
               "parked_bytes": float(sum(p.bytes_moved for p in parks))}
        last = parks[-1].residue if parks else {}
        if "process:nvml_before" in last and "process:outside_allocator" in last:
            from rota.residue import residue_left

            outside = last["process:outside_allocator"]
            out.update(parked_nvml_before=float(last["process:nvml_before"]), parked_outside_allocator=float(outside),
                       parked_nvml_after=float(outside + last.get("process:reserved", 0)),  # NVML's bytes after it
                       parked_residue=float(residue_left(parks[-1])))
        if not parks_only:
            out["wait_s"] = sum(e - s for kind, s, e in events if kind == "wait")
            out["restore_s"] = sum(e - s for kind, s, e in events if kind == "restore")
        return out

    def call(self, op: str, args: dict[str, Any], timing: dict[str, float]) -> tuple[Any, ...]:
        t0 = time.monotonic()
        try:
            return ("ok", getattr(self.worker, f"op_{op}")(**args))
        except Exception as e:
            return failed_reply(op, e)
        finally:
            timing["compute_s"] = time.monotonic() - t0

    def _run(self, batch: list[WorkUnit]) -> list[tuple[Any, ...]]:
        """The outcome of each unit of ``batch``: one unit, or units of one batched op run together by the worker's
        ``batch_OP``. Their timings get the shared ``compute_s``, ``batch_units`` (how many ran together) and what
        a result's ``"timing"`` adds (the sampler's decode batch per weights)."""
        op = batch[0][1]
        if op not in self.worker.BATCHED_OPS:
            return [self.call(op, batch[0][2], batch[0][3])]
        t0 = time.monotonic()
        try:
            results = getattr(self.worker, f"batch_{op}")([args for _, _, args, _ in batch])
        except Exception as e:
            results = [e] * len(batch)
        spent = time.monotonic() - t0
        for (_, _, _, timing), r in zip(batch, results, strict=True):
            timing.update(compute_s=spent, batch_units=float(len(batch)))
            if isinstance(r, dict):  # the worker's own account of the batch it ran this unit in
                timing.update(r.pop("timing", {}))
        return [failed_reply(op, r) if isinstance(r, Exception) else ("ok", r) for r in results]

    def reply(self, rid: str, outcome: tuple[Any, ...], timing: dict[str, float]) -> None:
        timing["done"] = time.monotonic()
        try:
            self.conn.send((rid, *outcome, timing))
        except (OSError, ValueError):  # the HTTP process is gone
            raise Stop from None

def failed_reply(op: str, e: Exception) -> tuple[Any, ...]:
    """The reply of a unit that raised: a UserError is the client's mistake, anything else the service's."""
    if isinstance(e, UserError):
        return ("err", str(e), "user")
    log.error("%s failed: %s", op, "".join(traceback.format_exception(e)))
    return ("err", f"{type(e).__name__}: {e}", "server")
