"""Shared LoRA turns: the LoRA steps of several tenants on one shared base run at once, in one rota turn.

Why: a LoRA step on a resident base leaves the device idle much of its wall time (Python
launches thousands of small kernels; the base's matmuls are short). Measured on an H200 with a
Qwen3-1.7B-shaped base and 8 x 256 tokens: 0.25 s for one step alone, 0.25 s each for two steps in
two processes at once, 0.50 s each for four (``bench/results/lora-step-procs-h200.json``). With
exclusive turns the second tenant would wait the whole first step.

With ``ServiceConfig.lora_concurrency`` > 1, the base holder of a (device, base) is the rota
tenant ``lora-shared.N`` of the service's group (:class:`SharedTurnGate`). It takes turns like any
tenant, against full-parameter tenants and other samplers. Inside its turn it admits up to
``lora_concurrency`` units on that base at once: LoRA trainers' units and samples from LoRA
weights or the bare base (:class:`SharedTurn` is a worker's side), each in its own process.
Their kernels interleave on the device but each unit runs its own kernels on its own tensors:
its numbers are what it computes alone.

What stays where: the adapters (and a trainer's Adam state) stay on the device for the model's life
(never parked, like the base). The shared turn's tenant reports its device use to rota as footprint ``working``:
the CUDA caches its workers keep between units (with their adapters), or the most units it ran at
once times the largest activation peak a unit reported, whichever is larger.

Fairness: when rota asks the shared turn to yield (another tenant waits past the policy's turn limit:
:data:`MAX_TURN_S` on the service's own orchestrator; give an external one ``--max-turn``), it
admits no new unit and releases the turn once its running units end; units still waiting queue for the next turn. An
idle shared turn is kept :data:`LINGER_S` for the next unit, then released. A worker that dies
inside a unit frees its place (its connection closes).
"""

from __future__ import annotations

import logging
import threading
import time
from multiprocessing import current_process
from multiprocessing.connection import Client
from typing import Any

from rota import hookimpl

log = logging.getLogger("rota_tinker.shared_turn")

MAX_TURN_S = 1.0  # the service's own orchestrator asks a holder to yield after this long when others wait
LINGER_S = 0.02  # an idle shared turn is kept this long for the next unit (a step's optim_step follows at once)


class SharedTurnGate:
    """The holder's side: admits units of workers on its base into its shared rota turn, ``limit`` at once.

    ``gpu``: the shared turn's rota tenant (``rota.connect``); the gate registers its footprint hook there.
    """

    def __init__(self, gpu: Any, limit: int, linger_s: float = LINGER_S) -> None:
        self.gpu, self.limit, self.linger_s = gpu, limit, linger_s
        self.cond = threading.Condition()
        self.running = 0  # units admitted and not yet left
        self.waiting = 0  # units asking to enter
        self.acquiring = False  # a waiter is getting the turn (outside the lock)
        self.idle_since = time.monotonic()
        self.most_at_once = 0
        self.largest_unit = 0  # bytes: the largest activation peak a unit reported
        self.kept: dict[int, int] = {}  # a worker connection -> the CUDA cache it kept after its last unit
        self.closed = False
        gpu.pm.register(self, name=f"rota-tinker-shared-turn-{id(self)}")
        self._watcher = threading.Thread(target=self._watch, name="rota-tinker-shared-turn-watch", daemon=True)
        self._watcher.start()

    @property
    def holding(self) -> bool:
        return self.gpu.grant is not None

    def enter(self) -> dict[str, float]:
        """Block until this unit may run; its timing (``wait_s``: for the grant, 0 in a held turn;
        ``new_turn``: 1 if it started the turn; ``units_sharing``: units running with it)."""
        t0 = time.monotonic()
        new_turn = 0.0
        with self.cond:
            self.waiting += 1
            try:
                while True:
                    if self.closed:
                        raise RuntimeError("the shared LoRA turn is shutting down")
                    if self.holding and not self.gpu.should_yield and self.running < self.limit:
                        self.running += 1
                        self.most_at_once = max(self.most_at_once, self.running)
                        return {"wait_s": time.monotonic() - t0, "new_turn": new_turn,
                                "units_sharing": float(self.running)}
                    if not self.holding and not self.acquiring and self.running == 0:
                        self._acquire()
                        new_turn = 1.0
                        continue
                    self.cond.wait(0.5)
            finally:
                self.waiting -= 1

    def _acquire(self) -> None:
        """Get the shared turn with the lock released (it may wait for other tenants); lock held again after."""
        self.acquiring = True
        self.cond.release()
        try:
            self.gpu.acquire()
        finally:
            self.cond.acquire()
            self.acquiring = False
            self.cond.notify_all()

    def leave(self, working_bytes: int = 0, kept_bytes: int = 0, worker: int = 0) -> None:
        """A unit ended (``working_bytes``: its activation peak on the device; ``kept_bytes``: the CUDA cache
        its worker process keeps for its next unit)."""
        with self.cond:
            self.running = max(0, self.running - 1)
            self.largest_unit = max(self.largest_unit, int(working_bytes))
            self.kept[worker] = int(kept_bytes)
            if self.running == 0:
                self.idle_since = time.monotonic()
                if self.gpu.should_yield:
                    self._release()
            self.cond.notify_all()

    def _release(self) -> None:
        """Give the turn back (lock held, nothing running)."""
        if not self.holding:
            return
        try:
            self.gpu.release()
        except Exception as e:  # the lease expires on the orchestrator's side; the next enter acquires afresh
            log.error("shared LoRA turn: release failed: %s", e)

    def _watch(self) -> None:
        """Release an idle turn: at once when rota asks the shared turn to yield, else after ``linger_s``."""
        while True:
            with self.cond:
                if self.closed:
                    return
                self.cond.wait(min(self.linger_s, 0.05))
                idle = self.running == 0 and not self.acquiring and self.holding
                if idle and (self.gpu.should_yield or
                             (self.waiting == 0 and time.monotonic() - self.idle_since >= self.linger_s)):
                    self._release()
                    self.cond.notify_all()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            if self.running == 0:
                self._release()
            self.cond.notify_all()

    def serve(self, conn: Any) -> None:
        """One worker's connection: ``("enter",)`` answered ``("ok", timing)`` or ``("err", why)``,
        ``("leave", peak bytes, kept bytes)``. A connection that closes inside a unit leaves it; one that
        closes frees its worker's cache (the process is gone or stopped sharing the turn)."""
        inside = False
        try:
            while True:
                msg = conn.recv()
                if msg[0] == "enter" and not inside:
                    try:
                        timing = self.enter()
                    except Exception as e:
                        conn.send(("err", f"{type(e).__name__}: {e}"))
                        continue
                    inside = True
                    conn.send(("ok", timing))
                elif msg[0] == "leave" and inside:
                    inside = False
                    self.leave(int(msg[1]), int(msg[2]), worker=id(conn))
                else:
                    conn.send(("err", f"unexpected {msg[0]!r} (inside a unit: {inside})"))
        except (EOFError, OSError):
            pass
        finally:
            if inside:
                log.warning("shared LoRA turn: a worker went away inside a unit; its place is free")
                self.leave(0, worker=id(conn))
            with self.cond:
                self.kept.pop(id(conn), None)
            conn.close()

    @hookimpl
    def rota_footprint(self, tenant: Any) -> dict[str, int] | None:
        """The shared turn's device bytes beyond the base: its workers' kept caches, or what the most units it ran at
        once needed (the larger), so rota leaves room for them when it decides who stays resident."""
        if tenant is not self.gpu:
            return None
        with self.cond:
            return {"working": max(self.most_at_once * self.largest_unit, sum(self.kept.values()))}


class SharedTurn:
    """A worker's (trainer's or sampler's) side of the shared turn of one base: the turn its shared units run in
    (``rota_tinker._worker.loop.Loop`` calls ``begin``, ``may_continue``, ``queued`` and ``end``, as on its own
    rota turn). A unit enters before it runs and leaves after; nothing of a model sharing it is ever parked."""

    NOTHING_MOVED = {"restore_s": 0.0, "parked_s": 0.0, "parked_bytes": 0.0}

    def __init__(self, address: str, device: Any, room_for: int = 1) -> None:
        self.address, self.device, self.room_for = address, device, room_for
        self.conn: Any = None  # connected at the first unit
        self._start_bytes = 0

    def begin(self) -> dict[str, float]:
        """Enter the shared turn (blocks while it is full or another tenant holds the device); the unit's timing."""
        import torch

        if self.conn is None:
            self.conn = Client(self.address, family="AF_UNIX", authkey=current_process().authkey)
            self.conn.send(("gate",))
        try:
            self.conn.send(("enter",))
            reply = self.conn.recv()
        except (EOFError, OSError) as e:
            self.conn = None
            raise RuntimeError(f"the base holder of this shared LoRA turn went away ({type(e).__name__})") from e
        if reply[0] != "ok":
            raise RuntimeError(f"the shared LoRA turn of this base refused the unit: {reply[1]}")
        self._start_bytes = 0
        if self.device.type == "cuda" and torch.cuda.is_initialized():  # its peak counters raise until it is
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start_bytes = torch.cuda.memory_allocated(self.device)
        return {**self.NOTHING_MOVED, **reply[1]}

    def may_continue(self) -> bool:
        """Queued units of this worker may join the unit: the gate counted it once."""
        return True

    def queued(self) -> dict[str, float]:
        """What a unit that joins a running one records."""
        return {"wait_s": 0.0, **self.NOTHING_MOVED}

    def end(self) -> None:
        """Leave the shared turn, reporting this unit's activation peak.

        This process keeps its CUDA cache for its next unit (no re-allocation) while the device has room
        for ``room_for`` more units like this one; with less free, it hands the cache back (every worker
        of the shared turn keeps its own cache, and together they must not crowd out the units that run). What
        it keeps is reported too: the shared turn's footprint counts it.
        """
        import torch

        peak = 0
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._start_bytes)
            if torch.cuda.mem_get_info(self.device)[0] < self.room_for * peak:
                torch.cuda.empty_cache()
        kept = torch.cuda.memory_reserved(self.device) if peak else 0
        self.conn.send(("leave", peak, kept))
