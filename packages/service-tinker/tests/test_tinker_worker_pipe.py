"""A worker that reads nothing for a while (a long batched pass) never holds up the service's threads.

Units go to a worker over a pipe; once it is full, a send waits until the worker reads. With 32 tenants on one
batched worker on an H200, HTTP threads waited there holding the handle's lock, which the thread delivering the
worker's replies also needs: the worker, blocked sending replies, never read again, and every SDK call
(heartbeats too) timed out. Here a real worker process is really paused (SIGSTOP) while more units than its
pipe holds are submitted: every submit returns at once, the handle's lock stays free, and once the worker
runs again every unit completes, in order.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rota.testing import running_orchestrator
from rota_tinker._http.handles import Future, WorkerHandle
from rota_tinker._worker.main import WorkerSpec

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
