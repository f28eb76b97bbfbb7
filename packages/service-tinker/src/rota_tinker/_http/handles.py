"""Worker processes as seen from the HTTP process: start, send a work unit, collect its result.

Used by :mod:`rota_tinker._http.service`. One :class:`WorkerHandle` per (tenant, role); a
reader thread turns each reply into the completion of a :class:`Future`. When the
process dies, every pending and later future of that worker fails with an error naming
the tenant, the role and the exit code; other tenants' workers are untouched.

The reader thread is the only one that reaps the process (two threads joining one
``multiprocessing.Process`` race on ``waitpid``: the loser sees it "alive" and kills a
process that exited cleanly). :meth:`WorkerHandle.close` waits on the process sentinel
and on the reader instead.

Every unit's timing (``Future.timing``, ``time.monotonic()`` stamps, which are one
system-wide clock on Linux, plus the worker's durations) says where its time went:
see :func:`unit_breakdown`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for
from typing import Any

from rota_tinker._worker.common import WorkerSpec
from rota_tinker._worker.main import main

log = logging.getLogger(__name__)


@dataclass
class Future:
    """A request's result, retrieved by ``retrieve_future``; completes exactly once."""

    request_id: str
    tenant: str
    kind: str  # ForwardBackward | OptimStep | CreateModel | SaveWeightsForSampler | Sample
    done: threading.Event = field(default_factory=threading.Event)
    proto: bytes | None = None  # a protobuf result (ForwardBackwardOutput, SampleResponse)
    json: dict[str, Any] | None = None  # a JSON result
    error: str | None = None
    category: str = "unknown"  # user | server | unknown (the SDK's RequestErrorCategory)
    # monotonic stamps and durations of this unit: submitted, recv, wait_s, restore_s, compute_s, ... answered
    timing: dict[str, float] = field(default_factory=dict)
    finished_at: float | None = None  # monotonic; the service forgets the future future_ttl_s after it
    delivered: bool = False  # its result was answered once (rota_tinker._http.budget lets it go a little later)
    dropped: bool = False  # its result was let go (answered a while ago): a later retrieve gets an error
    _callbacks: list[Callable[[], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def succeed(self, *, proto: bytes | None = None, json: dict[str, Any] | None = None) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.proto, self.json = proto, json
            self._finish()

    def fail(self, message: str, category: str) -> None:
        with self._lock:
            if self.done.is_set():
                return
            self.error, self.category = message, category
            self._finish()

    def _finish(self) -> None:
        self.finished_at = time.monotonic()
        self.done.set()
        callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def drop_result(self) -> None:
        """Let the result's bytes go (rota_tinker._http.budget); the future stays, for its timing."""
        with self._lock:
            self.proto, self.json, self.dropped = None, None, True

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the future completes (now, if it has): how a long poll waits without a thread."""
        with self._lock:
            if not self.done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def remove_done_callback(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._callbacks:
                self._callbacks.remove(fn)


OnResult = Callable[[Any], None]

# (name, later stamp, earlier stamp): the legs of a unit's life between two monotonic stamps
_LEGS = (("queue_s", "recv", "submitted"), ("reply_s", "result", "done"), ("encode_s", "encoded", "result"),
         ("answer_lag_s", "answered", "encoded"), ("total_s", "answered", "submitted"))
# durations measured inside the worker (see rota_tinker._worker.main)
DURATIONS = ("acquire_s", "wait_s", "restore_s", "compute_s", "release_s", "parked_s", "parked_bytes")
# device bytes of the worker process around its last park (NVML, CUDA only): before, after, outside the allocator;
# and what that park left on the device by rota's count (rota.residue.residue_left: the limit's measure)
PARK_READINGS = ("parked_nvml_before", "parked_nvml_after", "parked_outside_allocator", "parked_residue")
# the batched LoRA worker's passes (rota_tinker._worker.passes): the pass a unit finished in, the passes that ran from
# its arrival to its reply, and the decode steps of sample batches run meanwhile
PASS_COUNTS = ("pass", "passes", "decode_steps")


def unit_breakdown(timing: dict[str, float]) -> dict[str, float]:
    """Where one unit's time went, in seconds.

    ``queue_s``: in the worker's pipe, behind the tenant's earlier units; ``acquire_s``:
    getting the turn (``wait_s`` for the grant, ``restore_s`` moving parked state back;
    0 when the unit ran in a turn its tenant already held); ``compute_s``: the op itself;
    ``release_s``: giving the turn back (the last unit of a turn only); ``parked_s`` and
    ``parked_bytes``: this tenant's parks since its previous unit (off its own path, on the
    next holder's; for LoRA only adapter and Adam state should move, never the base);
    ``reply_s``: result back over the pipe; ``encode_s``: encoding it for the wire;
    ``answer_lag_s``: result ready until ``retrieve_future`` answered it; ``total_s``:
    submitted until answered. ``new_turn`` is 1 when the unit started a turn. A sample unit has
    ``batch_units``: the units decoded with it as one batch (itself included; one batch per
    weights), ``decode_rows``: that batch's rows (their ``num_samples`` summed); the units the
    sampler ran together share one ``compute_s``. On CUDA, a unit after a park of its tenant has
    :data:`PARK_READINGS`: NVML's bytes of the worker process just before and after that park and the
    part of them outside torch's allocator (its CUDA context, cuBLAS workspaces), and the residue rota counted
    against ``ROTA_RESIDUE_MAX_BYTES``. A unit of a shared LoRA turn (:mod:`rota_tinker._worker.shared_turn`)
    has ``units_sharing``: the units in the shared turn when it entered (itself included); its ``wait_s`` is
    its wait at the shared turn's gate. A unit of the batched LoRA worker has :data:`PASS_COUNTS`.
    """
    out = {k: float(timing[k]) for k in (*DURATIONS, *PARK_READINGS, "new_turn", "batch_units", "decode_rows",
                                         "units_sharing", *PASS_COUNTS) if k in timing}
    for name, hi, lo in _LEGS:
        if hi in timing and lo in timing:
            out[name] = max(0.0, timing[hi] - timing[lo])
    return out


def off_request_thread(fut: Future, what: str, fn: Callable[[], None]) -> None:
    """Run ``fn`` on a thread of its own, off the request thread: it may start worker processes (seconds on a GPU,
    under a handle's lock). Whatever it raises fails ``fut`` ("WHAT could not start"): a future never stays
    pending."""
    def run() -> None:
        try:
            fn()
        except Exception as e:
            log.exception("%s %s failed to start", what, fut.request_id)
            fut.fail(f"{what} could not start: {type(e).__name__}", "server")

    threading.Thread(target=run, name=f"rota-tinker-{what}-{fut.request_id}", daemon=True).start()


_STOP = object()  # tells a handle's sender thread to end


class _Outbox:
    """What a handle's sender thread sends, fairly: each tenant's units in the order they were submitted, the tenants
    in turn. A worker shared by tenants (the batched LoRA worker) reads its pipe in order, so one tenant's backlog
    sent first would reach it before another tenant's next unit; here that unit goes right after the unit being
    sent. The close message goes once every tenant's units have."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queues: OrderedDict[str, deque[Any]] = OrderedDict()
        self._closing: Any = None
        self._stopped = False

    def put(self, item: Any, tenant: str = "") -> None:
        with self._cond:
            self._queues.setdefault(tenant, deque()).append(item)
            self._cond.notify()

    def close(self, item: Any) -> None:
        """Send ``item`` after everything put before it, and nothing after it."""
        with self._cond:
            self._closing = item
            self._cond.notify()

    def stop(self) -> None:
        """The worker is gone: the sender ends now."""
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def get(self) -> Any:
        with self._cond:
            while not (self._stopped or self._queues or self._closing is not None):
                self._cond.wait()
            if self._stopped:
                return _STOP
            if not self._queues:
                item, self._closing = self._closing, None
                return item
            tenant, queue = next(iter(self._queues.items()))
            item = queue.popleft()
            del self._queues[tenant]
            if queue:  # its next unit waits for the other tenants' next ones
                self._queues[tenant] = queue
            return item


class WorkerHandle:
    """One worker process of one tenant, started lazily on first use.

    A start (seconds on a GPU: CUDA, the model) runs on a thread of its own and holds no lock that a unit's
    submit takes: units submitted meanwhile wait in a buffer and go to the worker once it is up (or fail
    with the start's error), so no caller of :meth:`submit` ever waits for a start; :meth:`ensure` does.
    """

    def __init__(self, spec: WorkerSpec, start_timeout_s: float) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: mp.process.BaseProcess | None = None
        self._pending: dict[str, tuple[Future, OnResult]] = {}
        self._dead: str | None = None
        self._closed = False
        self._reaped = threading.Event()  # set by the reader once it has joined the process
        self._outbox = _Outbox()  # what the sender thread sends
        self._starting: threading.Event | None = None  # a start in progress; set when it has ended
        self._buffer: list[Any] = []  # units submitted during that start, in order
        self.hello: dict[str, Any] = {}  # what the process said when it was ready (a base holder: its address)
        self.start_s: dict[str, float] = {}  # the last start: spawn (until the child ran), import, setup, total

    @property
    def name(self) -> str:
        return f"{self.spec.tenant}.{self.spec.role}"

    @property
    def running(self) -> bool:
        """Whether its process runs now."""
        return self._proc is not None and self._dead is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _spawn(self) -> tuple[mp.process.BaseProcess, Any, dict[str, Any]]:
        """Start the process and wait for its hello: (process, pipe end, hello). Holds no lock (seconds)."""
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=main, args=(self.spec, child), name=f"rota-tinker-{self.name}", daemon=True)
        t0 = time.monotonic()
        proc.start()
        child.close()
        if not parent.poll(self.start_timeout_s):
            proc.kill()
            proc.join(5)
            raise RuntimeError(f"{self.name} worker did not start within {self.start_timeout_s:.0f} s")
        try:
            hello = parent.recv()
        except EOFError as e:
            proc.join(5)
            raise RuntimeError(f"{self.name} worker exited while starting (exit code {proc.exitcode}); "
                               "see its log above") from e
        if hello[0] == "failed":
            proc.join(5)
            raise RuntimeError(f"{self.name} worker failed while starting: {hello[2]}")
        phases = hello[2].pop("start", {})
        self.start_s = {"spawn_s": phases.get("main_s", t0) - t0, "import_s": phases.get("import_s", 0.0),
                        "setup_s": phases.get("setup_s", 0.0), "total_s": time.monotonic() - t0}
        log.info("%s worker started, pid %s, in %s", self.name, hello[1],
                 " ".join(f"{k[:-2]} {v:.2f}s" for k, v in self.start_s.items()))
        return proc, parent, hello[2]

    def _start(self, done: threading.Event) -> None:
        """The starter thread: spawn, then install the process and send it the units buffered meanwhile (or fail
        them with why it could not start)."""
        try:
            proc, parent, hello = self._spawn()
        except Exception as e:
            proc = None
            why = f"{self.name} worker could not start: {e}"
            log.error("%s", why)
        with self._lock:
            buffered, self._buffer, self._starting = self._buffer, [], None
            if proc is None:
                self._dead = self._dead or why
                failed = [(future, self._dead) for _, future in buffered
                          if self._pending.pop(future.request_id, None) is not None]
            else:
                failed = []
                self._proc, self.hello = proc, hello
                reaped = self._reaped = threading.Event()
                outbox = self._outbox = _Outbox()
                for item in buffered:
                    outbox.put(item, item[1].tenant)
                if self._closed:  # the service closed while this started: the worker exits after what it has
                    outbox.close((None, None))
                threading.Thread(target=self._read, args=(parent, proc, reaped, outbox),
                                 name=f"rota-tinker-read-{self.name}", daemon=True).start()
                threading.Thread(target=self._send, args=(parent, outbox), name=f"rota-tinker-send-{self.name}",
                                 daemon=True).start()
        for future, why in failed:
            future.fail(why, "server")
        done.set()

    def _ensure_locked(self, restart: bool) -> tuple[str | None, threading.Event | None]:
        """Begin a start if the process is needed and none is under way: (why it cannot run, or None; the
        start in progress, or None when it runs). Never waits."""
        if self._dead is not None and restart and not self._closed and self._proc is not None:
            log.warning("%s: starting a fresh worker after: %s", self.name, self._dead)
            self._proc, self._dead = None, None
        if self._dead is not None:
            return self._dead, None
        if self._proc is None and self._starting is None:
            if self._closed:
                return f"{self.name} worker was stopped (service shutting down)", None
            self._starting = threading.Event()
            threading.Thread(target=self._start, args=(self._starting,), name=f"rota-tinker-start-{self.name}",
                             daemon=True).start()
        return None, self._starting

    def ensure(self, *, restart: bool = True) -> dict[str, Any]:
        """Start the process now (or a fresh one after a crash) and wait for it; its hello. RuntimeError if it
        cannot run. Waits up to the start timeout: call it off the request threads."""
        with self._lock:
            why, starting = self._ensure_locked(restart)
        if why is not None:
            raise RuntimeError(why)
        if starting is not None and not starting.wait(self.start_timeout_s + 30):
            raise RuntimeError(f"{self.name} worker did not start within {self.start_timeout_s:.0f} s")
        with self._lock:
            if self._dead is not None or self._proc is None:
                raise RuntimeError(self._dead or f"{self.name} worker did not start")
            return self.hello

    def submit(self, future: Future, op: str, args: dict[str, Any], on_result: OnResult, *,
               restart: bool = False) -> None:
        """Queue ``op`` for the worker (its sender thread sends it); ``on_result(result)`` completes ``future``
        (a failure fails it). Never waits: not on the worker's pipe, and not for a start (the unit waits for
        the worker instead, and fails with the start's error if it cannot start).

        ``restart``: if the worker has died, start a fresh one for this unit (its old state stays lost).
        """
        with self._lock:
            why, starting = self._ensure_locked(restart)
            if why is None:
                future.timing["submitted"] = time.monotonic()
                self._pending[future.request_id] = (future, on_result)
                item = ((future.request_id, op, args), future)
                if starting is not None:
                    self._buffer.append(item)
                else:
                    self._outbox.put(item, future.tenant)
        if why is not None:
            future.fail(why, "server")

    def _send(self, conn: Any, outbox: _Outbox) -> None:
        """Send the worker its units: each tenant's in submission order, the tenants in turn (:class:`_Outbox`). A
        thread of its own: a worker busy with a long pass reads
        nothing, and once the pipe is full a send waits; an HTTP thread (or the lock the reader needs to deliver
        the worker's replies) waiting there had stalled the whole service with 32 tenants on one batched worker."""
        while True:
            item = outbox.get()
            if item is _STOP:
                return
            msg, future = item
            try:
                conn.send(msg)
            except (OSError, ValueError) as e:
                if future is None:
                    return
                with self._lock:
                    entry = self._pending.pop(future.request_id, None)
                if entry is not None:
                    future.fail(f"{self.name} worker is gone ({e})", "server")
                continue
            if msg is None:  # the close message: nothing follows it
                return

    def _read(self, conn: Any, proc: mp.process.BaseProcess, reaped: threading.Event,
              outbox: _Outbox) -> None:
        """Complete futures from the worker's replies; when it exits, reap it (the only reaper) and fail the rest.

        Replies: ``(rid, "ok", result, timing)`` or ``(rid, "err", message, category, timing)``.
        """
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            received = time.monotonic()
            rid, status = msg[0], msg[1]
            with self._lock:
                entry = self._pending.pop(rid, None)
            if entry is None:
                continue
            future, on_result = entry
            future.timing.update(msg[-1], result=received)
            if status == "ok":
                try:
                    on_result(msg[2])
                except Exception as e:  # encoding the result failed: a server bug, reported as such
                    log.exception("%s: result of %s could not be encoded", self.name, rid)
                    future.fail(f"result could not be encoded: {e}", "server")
            else:
                future.fail(msg[2], msg[3])
            future.timing["encoded"] = time.monotonic()
            if log.isEnabledFor(logging.DEBUG):
                log.debug("%s %s %s: %s", self.name, future.kind, rid,
                          " ".join(f"{k}={v:.4f}" for k, v in unit_breakdown(future.timing).items()))
        outbox.stop()  # its sender has nobody left to send to
        proc.join(5)
        reaped.set()
        with self._lock:
            if self._proc is not proc:  # a fresh worker replaced this one already
                return
            self._dead = self._dead or (f"{self.name} worker exited (exit code {proc.exitcode}); the models it held "
                                        "are lost: create a new model (a fresh worker starts for it)")
            pending, self._pending = self._pending, {}
        if pending:
            log.error("%s; failing %d pending request(s)", self._dead, len(pending))
        for future, _ in pending.values():
            future.fail(self._dead, "server")

    def request_close(self) -> None:
        """Ask the worker to exit (it releases what it holds first); returns at once. New units fail."""
        with self._lock:
            self._closed = True
            self._dead = self._dead or f"{self.name} worker was stopped (service shutting down)"
            if self._proc is not None:
                self._outbox.close((None, None))  # after every unit submitted before it

    def wait_closed(self, deadline: float) -> bool:
        """Wait until ``deadline`` (monotonic) for the worker to exit; kill it after that. True if it exited itself."""
        with self._lock:
            starting = self._starting
        if starting is not None:  # a start under way installs its process (and asks it to exit) when it ends
            starting.wait(max(0.0, deadline - time.monotonic()))
        with self._lock:
            proc, reaped = self._proc, self._reaped
        if proc is None:
            return True
        exited = bool(wait_for([proc.sentinel], max(0.0, deadline - time.monotonic())))
        if not exited:
            log.warning("%s worker (pid %s) did not exit within its shutdown time; killing it", self.name, proc.pid)
            proc.kill()
        reaped.wait(10)
        return exited

    def close(self, timeout_s: float = 10.0) -> bool:
        """Ask the worker to exit; kill it if it does not within ``timeout_s``. True if it exited itself."""
        self.request_close()
        return self.wait_closed(time.monotonic() + timeout_s)


def close_all(handles: Iterable[WorkerHandle], timeout_s: float) -> list[str]:
    """Close ``handles`` together (one shared deadline, not one each); the names of those that had to be killed."""
    handles = list(handles)
    for h in handles:
        h.request_close()
    deadline = time.monotonic() + timeout_s
    return [h.name for h in handles if not h.wait_closed(deadline)]
