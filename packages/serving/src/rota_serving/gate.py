"""The turn gate: a served engine holds its group's turn only while requests need it.

Who calls it: :class:`rota_serving.TurnProxy` enters the gate around every request
that needs the GPU; ``serve_app`` builds one per served engine.

A request that needs the GPU enters the gate: if this tenant does not hold its group,
the gate acquires it (blocking the request, never failing it); the grant restores the
engine if it was parked. When no request has been in flight for ``idle_release_s``
the gate releases the turn; with nobody waiting the orchestrator parks nothing (lazy
parking), so the next request pays nothing. When the policy asks the holder to yield
(``gpu.should_yield``) new requests wait while the ones in flight finish, the turn is
released, and they queue again.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator

from rota import Gpu
from rota.errors import InvalidArgument, RotaError

log = logging.getLogger(__name__)


class TurnGate:
    """Holds ``gpu``'s turn while requests are in flight; acquires on demand, releases when idle.

    Thread-safe. ``idle_release_s`` = 0 releases as soon as the last request ends.
    """

    def __init__(self, gpu: Gpu, *, idle_release_s: float = 0.5) -> None:
        if not idle_release_s >= 0:
            raise InvalidArgument(f"idle_release_s={idle_release_s!r} must be >= 0 seconds")
        self.gpu, self.idle_release_s = gpu, idle_release_s
        self._cv = threading.Condition()
        self._inflight = 0
        self._held = False
        self._acquiring = False
        self._draining = False
        self._last_exit = time.monotonic()
        self._closed = False
        self.turns = 0
        self.acquire_waits: list[float] = []
        self._thread = threading.Thread(target=self._monitor, name=f"rota-gate-{gpu.tenant}", daemon=True)
        self._thread.start()

    @property
    def held(self) -> bool:
        return self._held

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """``with gate.turn():`` — the block runs while this tenant holds its group."""
        self.enter()
        try:
            yield
        finally:
            self.exit()

    def enter(self) -> None:
        with self._cv:
            while self._draining:
                self._cv.wait()
            self._inflight += 1
            try:
                while not self._held:
                    if self._acquiring:
                        self._cv.wait()
                        continue
                    self._acquiring = True
                    self._cv.release()
                    try:
                        t0 = time.monotonic()
                        self.gpu.acquire()
                        self.acquire_waits.append(time.monotonic() - t0)
                    finally:
                        self._cv.acquire()
                        self._acquiring = False
                        self._cv.notify_all()
                    self._held = True
                    self.turns += 1
            except BaseException:
                self._inflight -= 1
                self._cv.notify_all()
                raise

    def exit(self) -> None:
        with self._cv:
            self._inflight -= 1
            self._last_exit = time.monotonic()
            self._cv.notify_all()

    def release_now(self) -> None:
        """Release the turn once nothing is in flight (used on shutdown)."""
        with self._cv:
            self._draining = True
            while self._inflight:
                self._cv.wait(1.0)
            self._release_locked()
            self._draining = False
            self._cv.notify_all()

    def close(self) -> None:
        self.release_now()
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(5)

    def _release_locked(self) -> None:
        if self._held:
            self._held = False
            try:
                self.gpu.release()
            except RotaError as exc:
                log.warning("release of %s failed: %s", self.gpu.tenant, exc)

    def _monitor(self) -> None:
        with self._cv:
            while not self._closed:
                self._cv.wait(0.05)
                if not self._held or self._acquiring:
                    continue
                if self.gpu.should_yield and not self._draining:
                    self._draining = True  # new requests wait; the ones in flight finish
                if self._inflight:
                    continue
                if self._draining or time.monotonic() - self._last_exit >= self.idle_release_s:
                    self._release_locked()
                    self._draining = False
                    self._cv.notify_all()


__all__ = ["TurnGate"]
