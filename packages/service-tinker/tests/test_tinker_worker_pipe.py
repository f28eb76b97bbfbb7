"""A worker that reads nothing for a while (a long batched pass) never holds up the service's threads.

Units go to a worker over a pipe; once it is full, a send waits until the worker reads. With 32 tenants on one
batched worker on an H200, HTTP threads waited there holding the handle's lock, which the thread delivering the
worker's replies also needs: the worker, blocked sending replies, never read again, and every SDK call
(heartbeats too) timed out. Here a real worker process is really paused (SIGSTOP) while more units than its
pipe holds are submitted: every submit returns at once, the handle's lock stays free, and once the worker
runs again every unit completes, in order.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rota.testing import running_orchestrator
from rota_tinker._http.handles import Future, WorkerHandle
from rota_tinker._worker.common import WorkerSpec

HANG_GUARD_S = 60  # a hang, not a speed: the submits below take milliseconds when nothing blocks them


@pytest.fixture
def paused_worker(tmp_path: Path) -> Iterator[WorkerHandle]:
    with running_orchestrator() as (endpoint, _):
        spec = WorkerSpec(tenant="t", role="sampler", group="g", endpoint=endpoint, device="cpu",
                          data_dir=str(tmp_path))
        handle = WorkerHandle(spec, start_timeout_s=120)
        handle.ensure()
        os.kill(handle.pid, signal.SIGSTOP)
        try:
            yield handle
        finally:
            os.kill(handle.pid, signal.SIGCONT)
            handle.request_close()
            handle.wait_closed(time.monotonic() + 30)


def test_submits_to_a_worker_that_reads_nothing_return_at_once(paused_worker: WorkerHandle) -> None:
    futures = [Future(f"r{i}", "t", "Forget") for i in range(24)]
    order: list[str] = []
    key = "k" * (256 << 10)  # 24 x 256 KiB: far more than a pipe holds

    def submit_all() -> None:
        for f in futures:
            paused_worker.submit(f, "forget", {"key": key}, lambda result, f=f: (order.append(f.request_id),
                                                                                 f.succeed(json=result)))

    t = threading.Thread(target=submit_all, daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), "a submit waited on the paused worker's pipe"
    assert paused_worker._lock.acquire(timeout=HANG_GUARD_S), "the handle's lock is held while the worker is paused"
    paused_worker._lock.release()
    assert not any(f.done.is_set() for f in futures)  # the worker really read nothing
    os.kill(paused_worker.pid, signal.SIGCONT)
    for f in futures:
        assert f.done.wait(HANG_GUARD_S), f.request_id
        assert f.error is None, f.error
    assert order == [f.request_id for f in futures]


@pytest.fixture
def spec(tmp_path: Path) -> Iterator[WorkerSpec]:
    with running_orchestrator() as (endpoint, _):
        yield WorkerSpec(tenant="t", role="sampler", group="g", endpoint=endpoint, device="cpu",
                         data_dir=str(tmp_path))


@pytest.fixture
def held(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[threading.Event, threading.Event, list[WorkerHandle]]]:
    """Every start held at a gate (a worker that takes long to start: CUDA and the model on a GPU): (starting,
    gate, handles to close at the end)."""
    starting, gate, handles = threading.Event(), threading.Event(), []
    real = WorkerHandle._spawn

    def spawn(self: WorkerHandle):
        starting.set()
        assert gate.wait(HANG_GUARD_S), "the test never opened the gate"
        return real(self)

    monkeypatch.setattr(WorkerHandle, "_spawn", spawn)
    yield starting, gate, handles
    gate.set()
    for h in handles:
        h.close(30)


def _forget(handle: WorkerHandle, rid: str, order: list[str] | None = None) -> Future:
    """Submit a cheap unit; its request id goes to ``order`` when its result arrives."""
    fut = Future(rid, "t", "Forget")
    seen = order if order is not None else []
    handle.submit(fut, "forget", {"key": "k"}, lambda r: (seen.append(rid), fut.succeed(json=r)))
    return fut


def test_units_submitted_while_the_worker_starts_wait_for_it_without_holding_their_callers(spec, held) -> None:
    """A start (seconds on a GPU; a crashed shared worker restarted for one tenant) holds nothing that a submit
    takes: units of other callers submitted meanwhile return at once, then run in order once it is up."""
    starting, gate, handles = held
    handle = WorkerHandle(spec, start_timeout_s=120)
    handles.append(handle)
    waiter = threading.Thread(target=handle.ensure, daemon=True)  # create_model's start, off its request thread
    waiter.start()
    assert starting.wait(HANG_GUARD_S)
    order: list[str] = []
    futures: list[Future] = []
    t = threading.Thread(target=lambda: futures.extend(_forget(handle, f"r{i}", order) for i in range(3)), daemon=True)
    t.start()
    t.join(HANG_GUARD_S)
    assert not t.is_alive(), "a submit waited for the worker's start"
    assert not handle.running and waiter.is_alive() and not any(f.done.is_set() for f in futures)
    gate.set()
    waiter.join(HANG_GUARD_S)
    assert not waiter.is_alive() and handle.running
    for f in futures:
        assert f.done.wait(HANG_GUARD_S) and f.error is None, f.error
    assert order == ["r0", "r1", "r2"]


def test_units_waiting_for_a_start_that_fails_fail_with_its_error(spec, held) -> None:
    starting, gate, handles = held
    handle = WorkerHandle(dataclasses.replace(spec, device="no-such-device"), start_timeout_s=120)
    handles.append(handle)
    fut = _forget(handle, "r0")
    assert starting.wait(HANG_GUARD_S) and not fut.done.is_set()
    gate.set()
    assert fut.done.wait(HANG_GUARD_S)
    assert (fut.error or "").startswith("t.sampler worker could not start") and fut.category == "server", fut.error
    with pytest.raises(RuntimeError, match=r"t\.sampler worker could not start"):
        handle.ensure()


def test_a_close_during_a_start_stops_the_worker_that_start_brings_up(spec, held) -> None:
    starting, gate, _ = held
    handle = WorkerHandle(spec, start_timeout_s=120)
    fut = _forget(handle, "r0")
    assert starting.wait(HANG_GUARD_S)
    handle.request_close()
    late = _forget(handle, "r1")
    assert late.done.is_set() and "stopped" in (late.error or "")  # after the close: refused at once
    gate.set()
    assert handle.wait_closed(time.monotonic() + HANG_GUARD_S)  # the started worker was asked to exit, and did
    assert fut.done.wait(HANG_GUARD_S) and fut.error is None  # the unit submitted before the close still ran
    assert handle.pid is not None and not handle.running
