"""One worker process: the trainer or the sampler of one tenant.

Started by :mod:`rota_tinker._http.handles` with the ``spawn`` method; talks to the HTTP
process over a ``multiprocessing`` pipe: requests ``(request_id, op, args)``, replies
``(request_id, "ok", result, timing)`` or ``(request_id, "err", message, category,
timing)``; ``None`` asks it to exit. Work units run in arrival order (queued samples together).

Every device work unit (creating a model, ``forward_backward``, ``optim_step``, a
sampling batch) runs inside a turn of the tenant's rota tenant (``<tenant>.trainer`` /
``<tenant>.sampler``) on the service's group, so tenants take turns on shared devices.
Units already queued when one finishes run in the **same turn** (up to
``units_per_turn``, and not once the policy asks the tenant to yield): the
``optim_step`` the SDK sends right behind a ``forward_backward`` costs no second switch.
Sample units queued together run as **one decode batch** (per weights; see
:mod:`rota_tinker._worker.sampling`): the sampler's ``batch_sample`` takes them all at once.
Each reply carries the unit's timing (turn wait, restore, compute, release; see
:func:`rota_tinker._http.handles.unit_breakdown`). What is parked between turns (by
:mod:`rota_fsdp`):

* full-parameter models: weights, grads and the Adam state;
* LoRA models: only the adapter weights and their Adam state; the base model stays
  resident (it is never trained);
* sampler models: the weights a sampling session samples from (the adapter only, for
  LoRA).

LoRA models (and base-only samplers) do not load their own base when the service shares
bases (the default): they :func:`rota_tinker._worker.holder.attach` to the resident copy of the
base-holder process of their (device, base), which is role ``base`` here (no rota
tenant: the base is resident, never parked, and read-only).

With ``lora_concurrency`` > 1 (:mod:`rota_tinker._worker.shared_turn`) the device units of LoRA models on a shared
base, and samples on a shared base, run in that base's shared LoRA turn instead: several tenants' units at
once in one rota turn; such models are never tracked (they stay on the device).

On CUDA each worker also reports its **working set** to the orchestrator (footprint tag
``working``): the CUDA cache its last turn needed beyond its tracked tensors
(activations, workspaces). With a service ``capacity_bytes`` the orchestrator counts it
when it decides which tenants stay resident, so residents never add up past the device.

Saving weights for the sampler needs no device: it is written from the tracked host
copy (``Tracked.state_dict()``), without a turn, to ``DATA_DIR/TENANT/MODEL/sampler_weights/NAME/``
in the files peft and transformers load (:mod:`rota_tinker._worker.state_files`; directories 0700,
files 0600). Unloading a model
(``unload``) or forgetting a sampler's weights (``forget``) untracks it inside a turn
(a parked model is restored before it is dropped, so that must not happen outside one).

On exit a worker drops every model and its references to a shared base before its
process ends, so a CUDA base holder sees its IPC tensors released (the service stops
tenant workers, waits for them, then the holders).
"""

from __future__ import annotations

import gc
import logging
import os
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from rota import hookimpl

log = logging.getLogger("rota_tinker.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; picklable for ``spawn``."""

    tenant: str
    role: str  # "trainer" | "sampler" | "base" (.holder.BaseHolder) | "batch" (.batch.BatchTrainer)
    group: str
    endpoint: str | None
    device: str
    data_dir: str
    torch_threads: int = 1
    base: Any = None  # the BaseModelSpec a base holder holds (role "base" only)
    units_per_turn: int = 4  # queued units of this tenant that may share one turn
    release_cached: bool = True  # empty the CUDA cache after each park (ServiceConfig.release_cached)
    deterministic: bool = False  # torch.use_deterministic_algorithms (ServiceConfig.deterministic)
    lora_concurrency: int = 1  # > 1: LoRA units on a shared base run in its shared turn (._worker.shared_turn)
    shared_turn_job: str = ""  # a base holder's rota job id as its shared turn's tenant (lora_concurrency > 1)
    lora_batch_tokens: int = 0  # role "batch": the most tokens of one model in one batched pass


# tokens of one forward/backward micro-batch: bounds the float32 logits (~5 GB at a 150k vocabulary)
MICRO_BATCH_TOKENS = 8192


class UserError(Exception):
    """The request was wrong (reported to the client with category ``user``)."""


def main(spec: WorkerSpec, conn: Connection) -> None:
    """Worker entry point (the ``spawn`` target)."""
    t0 = time.monotonic()
    logging.basicConfig(level=os.environ.get("ROTA_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s {spec.tenant}.{spec.role} %(levelname)s %(name)s: %(message)s")
    os.environ["HF_HUB_OFFLINE"] = "1"  # nothing is ever downloaded: models come from their local snapshots
    if spec.deterministic:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before CUDA starts: cuBLAS's reproducible mode
    import torch

    import rota

    imported = time.monotonic()
    torch.set_num_threads(spec.torch_threads)
    if spec.deterministic:
        torch.use_deterministic_algorithms(True)
    gpu, working = None, None
    try:
        if spec.role == "base":
            from rota_tinker._worker.holder import BaseHolder

            worker: Any = BaseHolder(spec)
            hello = worker.hello()
        else:
            name = spec.tenant if spec.role == "batch" else f"{spec.tenant}.{spec.role}"
            gpu = rota.connect(group=spec.group, tenant=name, endpoint=spec.endpoint)
            worker = _roles()[spec.role](spec, gpu)
            if worker.device.type == "cuda":
                working = WorkingSet(gpu, worker.device)
                ParkMeter(gpu, worker.device)
            hello = {}
    except Exception as e:  # the service names the cause (e.g. a base model file that does not fit its spec)
        log.error("could not start: %s", traceback.format_exc())
        conn.send(("failed", os.getpid(), f"{type(e).__name__}: {e}"))
        if gpu is not None:
            gpu.close()
        return
    # where the start went (the service reports it): imports, then the worker (CUDA, a base holder's base)
    hello["start"] = {"main_s": t0, "import_s": imported - t0, "setup_s": time.monotonic() - imported}
    conn.send(("ready", os.getpid(), hello))
    try:
        _Loop(worker, gpu, conn, spec.units_per_turn, working).run()
    finally:
        try:  # leave quietly: the orchestrator may already be gone when the service shuts down
            if gpu is not None and gpu.grant is not None:
                gpu.release()
        except Exception as e:
            log.warning("release at exit failed: %s", e)
        worker.close()
        if gpu is not None:
            gpu.close()


def _roles() -> dict[str, type]:
    from rota_tinker._worker.batch import BatchTrainer
    from rota_tinker._worker.roles import Sampler, Trainer

    return {"trainer": Trainer, "sampler": Sampler, "batch": BatchTrainer}


_Unit = tuple[str, str, dict[str, Any], dict[str, float]]  # request id, op, its arguments, its timing


class _Stop(Exception):
    """The HTTP process asked this worker to exit (or went away)."""


class WorkingSet:
    """The ``working`` footprint of a CUDA tenant: its last turn's peak CUDA cache beyond its tracked tensors.

    Registered on the tenant's plugin manager: ``rota_turn_started`` restarts the allocator's peak, and the
    worker's loop calls :meth:`turn_ended` just before its release (``rota_turn_ended`` comes after the
    release, which already reports the footprint), so ``rota_footprint``, called on every acquire and
    heartbeat, only reads a number. ``peak`` and ``reset`` read and restart the allocator's peak
    (``torch.cuda``'s for ``device`` by default).
    """

    def __init__(self, gpu: Any, device: Any, *, peak: Callable[[], int] | None = None,
                 reset: Callable[[], None] | None = None) -> None:
        import torch

        self.gpu, self.bytes = gpu, 0
        # torch.cuda's peak counters raise "Invalid device argument" until this process has used CUDA
        self._peak = peak or (lambda: torch.cuda.max_memory_reserved(device) if torch.cuda.is_initialized() else 0)
        self._reset = reset or (
            lambda: torch.cuda.reset_peak_memory_stats(device) if torch.cuda.is_initialized() else None)
        gpu.pm.register(self, name=f"rota-tinker-working-set-{id(self)}")

    @hookimpl
    def rota_turn_started(self, tenant: Any, grant: Any) -> None:
        if tenant is not self.gpu:
            return
        try:
            self._reset()
        except Exception as e:  # a measurement must never cost the tenant its worker
            log.warning("working set: could not reset the allocator's peak: %s", e)

    def turn_ended(self) -> None:
        """Measure the turn that is ending: its peak beyond what the tenant tracks."""
        try:
            tracked = sum(v for k, v in self.gpu.footprint().items() if k != "working")
            self.bytes = max(0, self._peak() - tracked)
        except Exception as e:
            log.warning("working set: could not read the allocator's peak (keeping %d bytes): %s", self.bytes, e)

    @hookimpl
    def rota_footprint(self, tenant: Any) -> dict[str, int] | None:
        return {"working": self.bytes} if tenant is self.gpu else None


class ParkMeter:
    """NVML's bytes of this worker process just before each park of its tenant (every tracked model).

    A hook wrapper around ``rota_park``: it adds one part, ``process:nvml_before``, after every adapter parked.
    What the park left is read once, by rota_torch's last part (``process:outside_allocator`` + ``reserved``:
    NVML's bytes after it), so the two say what the whole park gave back to the driver.
    """

    def __init__(self, gpu: Any, device: Any) -> None:
        self.gpu, self.device = gpu, device
        gpu.pm.register(self, name=f"rota-tinker-park-meter-{id(self)}")

    @hookimpl(wrapper=True)
    def rota_park(self, tenant: Any, plan: Any) -> Any:
        from rota_torch import process_device_bytes

        before = process_device_bytes(self.device) if tenant is self.gpu else None
        parts = yield
        if before is not None:
            from rota import ParkResult

            parts.append(ParkResult(residue={"process:nvml_before": before}))
        return parts


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


class _OwnTurn:
    """The tenant's own rota turn (``<tenant>.trainer`` / ``.sampler``): acquire, restore, release."""

    def __init__(self, loop: _Loop) -> None:
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


class _Loop:
    """Runs units in arrival order; device units in turns, queued units of this tenant sharing one."""

    def __init__(self, worker: Any, gpu: Any, conn: Connection, units_per_turn: int,
                 working: WorkingSet | None = None) -> None:
        self.worker, self.gpu, self.conn, self.units_per_turn = worker, gpu, conn, max(1, units_per_turn)
        self.working = working
        self.seen = 0  # gpu.stats.events already attributed to a unit (a running total)
        self.parks_seen = 0  # gpu.stats.parks likewise
        self.pending: deque[_Unit] = deque()  # received while a turn of another kind ran: next in line
        self.own = _OwnTurn(self) if gpu is not None else None

    def run(self) -> None:
        try:
            while True:
                self._unit(self.pending.popleft() if self.pending else self._recv())
        except _Stop:
            return

    def _recv(self) -> _Unit:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):
            raise _Stop from None
        if msg is None:
            raise _Stop
        rid, op, args = msg
        return rid, op, args, {"recv": time.monotonic()}

    def _turn_of(self, unit: _Unit) -> Any:
        """The turn ``unit`` runs in: its base's shared LoRA turn, the tenant's own, or None (no device needed)."""
        if self.own is None:  # a base holder: nothing it runs takes a turn
            return None
        shared = self.worker.shared_turn_of(unit[1], unit[2])
        if shared is not None:
            return shared
        return self.own if self.worker.needs_turn(unit[1], unit[2]) else None

    def _unit(self, msg: _Unit) -> None:
        """One unit; a device unit takes a turn and runs whatever is queued behind it in the same turn."""
        rid, op, args, timing = msg
        turn = self._turn_of(msg)
        if turn is None:
            self._reply(rid, self._call(op, args, timing), timing)
            return
        t0 = time.monotonic()
        try:
            started = turn.begin()
        except Exception as e:  # the orchestrator is gone or the restore failed: this unit fails, the next retries
            log.error("%s: could not get a turn: %s", op, e)
            timing["acquire_s"] = time.monotonic() - t0
            self._reply(rid, ("err", f"could not get a turn on the device: {type(e).__name__}: {e}", "server"),
                        timing)
            return
        timing.update(acquire_s=time.monotonic() - t0, **started)
        queue, ran, stop = [msg], 0, False  # units received for this turn and not run yet, in arrival order
        while queue:
            batched = queue[0][1] in self.worker.BATCHED_OPS
            if batched and not stop:  # the units queued behind it may join its batch
                linger = self.worker.LINGER_S
                if linger and len(queue) == 1:  # its companion (an optim_step sent right behind it) may be in flight
                    self.conn.poll(linger)
                stop = self._take_queued(queue, self.units_per_turn - ran, turn)
            mixed = self.worker.MIXED_BATCHES  # any batched ops together (batch_mixed)
            n = next((i for i, unit in enumerate(queue) if (unit[1] not in self.worker.BATCHED_OPS if mixed
                                                            else unit[1] != queue[0][1])), len(queue)) if batched else 1
            batch, queue = queue[:n], queue[n:]
            outcomes = self._run(batch)
            ran += len(batch)
            if not queue and not stop and ran < self.units_per_turn:
                stop = self._take_queued(queue, 1, turn)
            if not queue:
                self._end_turn(turn, batch[-1][3])
            for (rid, _, _, timing), outcome in zip(batch, outcomes, strict=True):
                self._reply(rid, outcome, timing)
        if stop:
            raise _Stop

    def _take_queued(self, queue: list[_Unit], limit: int, turn: Any) -> bool:
        """Receive units already waiting in the pipe into ``queue`` (up to ``limit`` units in it), while the turn
        may go on; a unit of another turn waits in ``pending`` and ends the taking. True if the HTTP process
        asked this worker to stop meanwhile."""
        while len(queue) < limit and not self.pending and turn.may_continue() and self.conn.poll(0):
            try:
                unit = self._recv()
            except _Stop:
                return True
            if self._turn_of(unit) not in (turn, None):
                self.pending.append(unit)
                break
            unit[3].update(acquire_s=0.0, new_turn=0.0, **turn.queued())
            queue.append(unit)
        return False

    def _end_turn(self, turn: Any, timing: dict[str, float]) -> None:
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

    def _call(self, op: str, args: dict[str, Any], timing: dict[str, float]) -> tuple[Any, ...]:
        t0 = time.monotonic()
        try:
            return ("ok", getattr(self.worker, f"op_{op}")(**args))
        except Exception as e:
            return _failed(op, e)
        finally:
            timing["compute_s"] = time.monotonic() - t0

    def _run(self, batch: list[_Unit]) -> list[tuple[Any, ...]]:
        """The outcome of each unit of ``batch``: one unit, or units of one batched op run together by the worker's
        ``batch_OP``. Their timings get the shared ``compute_s``, ``batch_units`` (how many ran together) and what
        a result's ``"timing"`` adds (the sampler's decode batch per weights)."""
        op = batch[0][1]
        if op not in self.worker.BATCHED_OPS:
            return [self._call(op, batch[0][2], batch[0][3])]
        t0 = time.monotonic()
        try:
            if self.worker.MIXED_BATCHES:
                results = self.worker.batch_mixed([(o, args) for _, o, args, _ in batch])
            else:
                results = getattr(self.worker, f"batch_{op}")([args for _, _, args, _ in batch])
        except Exception as e:
            results = [e] * len(batch)
        spent = time.monotonic() - t0
        for (_, _, _, timing), r in zip(batch, results, strict=True):
            timing.update(compute_s=spent, batch_units=float(len(batch)))
            if isinstance(r, dict):  # the worker's own account of the batch it ran this unit in
                timing.update(r.pop("timing", {}))
        return [_failed(op, r) if isinstance(r, Exception) else ("ok", r) for r in results]

    def _reply(self, rid: str, outcome: tuple[Any, ...], timing: dict[str, float]) -> None:
        timing["done"] = time.monotonic()
        try:
            self.conn.send((rid, *outcome, timing))
        except (OSError, ValueError):  # the HTTP process is gone
            raise _Stop from None


def _failed(op: str, e: Exception) -> tuple[Any, ...]:
    """The reply of a unit that raised: a UserError is the client's mistake, anything else the service's."""
    if isinstance(e, UserError):
        return ("err", str(e), "user")
    log.error("%s failed: %s", op, "".join(traceback.format_exception(e)))
    return ("err", f"{type(e).__name__}: {e}", "server")
