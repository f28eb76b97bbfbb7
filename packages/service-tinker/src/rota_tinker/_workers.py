"""Worker processes as seen from the HTTP process: start, send a work unit, collect its result.

Used by :mod:`rota_tinker._service`. One :class:`WorkerHandle` per (tenant, role); a
reader thread turns each reply into the completion of a :class:`Future`. When the
process dies, every pending and later future of that worker fails with an error naming
the tenant, the role and the exit code; other tenants' workers are untouched.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rota_tinker._worker import WorkerSpec, main

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

    def succeed(self, *, proto: bytes | None = None, json: dict[str, Any] | None = None) -> None:
        if not self.done.is_set():
            self.proto, self.json = proto, json
            self.done.set()

    def fail(self, message: str, category: str) -> None:
        if not self.done.is_set():
            self.error, self.category = message, category
            self.done.set()


OnResult = Callable[[Any], None]


class WorkerHandle:
    """One worker process of one tenant, started lazily on first use."""

    def __init__(self, spec: WorkerSpec, start_timeout_s: float) -> None:
        self.spec = spec
        self.start_timeout_s = start_timeout_s
        self._lock = threading.Lock()
        self._proc: mp.process.BaseProcess | None = None
        self._conn: Any = None
        self._pending: dict[str, tuple[Future, OnResult]] = {}
        self._dead: str | None = None
        self._closed = False
        self.hello: dict[str, Any] = {}  # what the process said when it was ready (a base holder: its address)

    @property
    def name(self) -> str:
        return f"{self.spec.tenant}.{self.spec.role}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def _start_locked(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=main, args=(self.spec, child), name=f"rota-tinker-{self.name}", daemon=True)
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
        log.info("%s worker started, pid %s", self.name, hello[1])
        self._proc, self._conn, self.hello = proc, parent, hello[2]
        threading.Thread(target=self._read, name=f"rota-tinker-read-{self.name}", daemon=True).start()

    def _ensure_locked(self, restart: bool) -> str | None:
        """Start the process if needed; None when it runs, else why it does not."""
        if self._dead is not None and restart and not self._closed and self._proc is not None:
            log.warning("%s: starting a fresh worker after: %s", self.name, self._dead)
            self._proc, self._conn, self._dead = None, None, None
        if self._dead is not None:
            return self._dead
        if self._proc is None:
            try:
                self._start_locked()
            except Exception as e:
                self._dead = f"{self.name} worker could not start: {e}"
                log.error("%s", self._dead)
                return self._dead
        return None

    def ensure(self, *, restart: bool = True) -> dict[str, Any]:
        """Start the process now (or a fresh one after a crash); its hello. RuntimeError if it cannot run."""
        with self._lock:
            why = self._ensure_locked(restart)
            if why is not None:
                raise RuntimeError(why)
            return self.hello

    def submit(self, future: Future, op: str, args: dict[str, Any], on_result: OnResult, *,
               restart: bool = False) -> None:
        """Send ``op`` to the worker; ``on_result(result)`` completes ``future`` (a failure fails it).

        ``restart``: if the worker has died, start a fresh one for this unit (its old state stays lost).
        """
        with self._lock:
            why = self._ensure_locked(restart)
            if why is not None:
                future.fail(why, "server")
                return
            self._pending[future.request_id] = (future, on_result)
            try:
                self._conn.send((future.request_id, op, args))
            except (OSError, ValueError) as e:
                self._pending.pop(future.request_id, None)
                future.fail(f"{self.name} worker is gone ({e})", "server")

    def _read(self) -> None:
        conn, proc = self._conn, self._proc
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            rid, status = msg[0], msg[1]
            with self._lock:
                entry = self._pending.pop(rid, None)
            if entry is None:
                continue
            future, on_result = entry
            if status == "ok":
                try:
                    on_result(msg[2])
                except Exception as e:  # encoding the result failed: a server bug, reported as such
                    log.exception("%s: result of %s could not be encoded", self.name, rid)
                    future.fail(f"result could not be encoded: {e}", "server")
            else:
                future.fail(msg[2], msg[3])
        proc.join(5)
        with self._lock:
            if self._proc is not proc:  # a fresh worker replaced this one already
                return
            self._dead = (f"{self.name} worker exited (exit code {proc.exitcode}); the models it held are lost: "
                          "create a new model (a fresh worker starts for it)")
            pending, self._pending = self._pending, {}
        if pending:
            log.error("%s; failing %d pending request(s)", self._dead, len(pending))
        for future, _ in pending.values():
            future.fail(self._dead, "server")

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the worker to exit; kill it if it does not within ``timeout_s``."""
        with self._lock:
            proc, conn = self._proc, self._conn
            self._closed = True
            self._dead = self._dead or f"{self.name} worker was stopped (service shutting down)"
        if proc is None:
            return
        try:
            conn.send(None)
        except (OSError, ValueError):
            pass
        deadline = time.monotonic() + timeout_s
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            log.warning("%s worker did not exit in %.0f s; killing it", self.name, timeout_s)
            proc.kill()
            proc.join(5)
