"""How a server run by ``serve_in_thread`` (the in-process orchestrator of ``rota demo`` and tests, the node agent)
ends: the tasks left once the server has stopped get to end on their own, and only those still running after
``SETTLE_S`` are cancelled.

Why: at Ctrl-C of ``rota demo`` an Attach stream could still be detaching its tenant when the loop's last tasks
were cancelled; grpc's wrapper task, cancelled while it awaited that handler, logged a ``CancelledError``
traceback ("Exception not handled by _handle_exceptions") and the demo's clean interrupt was not clean
(``test_ctrl_c_stops_every_worker_without_tracebacks`` failed in CI at 5e20e33, and once before).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from rota._orchestrator import grpc_server
from rota.rpc import serve_in_thread


def _server_leaving(coro_factory: Callable[[dict], Awaitable[None]]) -> Callable[[], Awaitable[Any]]:
    """A ``start`` whose ``stop`` leaves one task (made by ``coro_factory``) running; the task is the handle."""
    holder: dict[str, Any] = {}

    async def start() -> tuple[dict, Callable[[], Awaitable[None]]]:
        async def stop() -> None:
            holder["task"] = asyncio.get_running_loop().create_task(coro_factory(holder))

        return holder, stop

    return start


def test_a_task_still_ending_when_the_server_stops_ends_on_its_own() -> None:
    async def finishing(holder: dict) -> None:
        try:
            await asyncio.sleep(0.2)  # an Attach handler detaching its tenant
            holder["ended"] = "on its own"
        except asyncio.CancelledError:
            holder["ended"] = "cancelled"
            raise

    with serve_in_thread(_server_leaving(finishing), name="test-settle") as (holder, _loop):
        pass
    assert holder["ended"] == "on its own"


def test_a_task_that_never_ends_is_cancelled_after_the_settle_time(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(grpc_server, "SETTLE_S", 0.3)

    async def forever(holder: dict) -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            holder["ended"] = "cancelled"
            raise

    t0 = time.monotonic()
    with serve_in_thread(_server_leaving(forever), name="test-settle") as (holder, _loop):
        pass
    assert holder["ended"] == "cancelled"
    assert time.monotonic() - t0 < 5
