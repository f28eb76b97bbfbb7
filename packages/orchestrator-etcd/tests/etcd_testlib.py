"""Helpers shared by rota_etcd's tests (imported by name: pytest puts this folder on sys.path)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from rota.wire import timeslice_orchestrator_pb2 as v1a
from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc

T = TypeVar("T")


def run(coro: Awaitable[T], timeout: float = 60) -> T:
    """Run an async test body to completion."""
    return asyncio.run(asyncio.wait_for(coro, timeout))  # type: ignore[arg-type]


def v1_stub(endpoint: str) -> tuple[grpc.Channel, v1a_grpc.TimeSliceOrchestratorServiceStub]:
    ch = grpc.insecure_channel(endpoint)
    return ch, v1a_grpc.TimeSliceOrchestratorServiceStub(ch)


def v1_acquire(endpoint: str, job: str, group: str, timeout: float = 10) -> v1a.AcquireResponse:
    ch, stub = v1_stub(endpoint)
    with ch:
        return stub.Acquire(v1a.AcquireRequest(job_id=job, group_id=group), timeout=timeout)


def v1_yield(endpoint: str, job: str, group: str) -> v1a.YieldResponse:
    ch, stub = v1_stub(endpoint)
    with ch:
        return stub.Yield(v1a.YieldRequest(job_id=job, group_id=group), timeout=10)


class Background:
    """Run a blocking call in a thread; ``result()`` waits for it (re-raising its error)."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._out: dict[str, Any] = {}

        def body() -> None:
            try:
                self._out["value"] = fn()
            except BaseException as exc:
                self._out["error"] = exc

        self.thread = threading.Thread(target=body, daemon=True)
        self.thread.start()

    def done(self) -> bool:
        return not self.thread.is_alive()

    def result(self, timeout: float = 30) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise AssertionError(f"background call still blocked after {timeout:g} s")
        if "error" in self._out:
            raise self._out["error"]
        return self._out["value"]
