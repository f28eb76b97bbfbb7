"""What every rota gRPC server shares: error mapping, binding, health, a thread to run in.

Used by the orchestrator (:mod:`rota._service`, :mod:`rota._inproc`) and by the node
agent (``rota_agent``), so both map :class:`rota.errors.RotaError` to the status codes
of shared/WIRE.md the same way and fail the same way on a bad ``--listen``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from rota.errors import InvalidArgument, RotaError


def rpc_errors(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Decorate a servicer method: a RotaError aborts the RPC with its code and message."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await fn(self, request, context)
        except RotaError as exc:
            await context.abort(exc.code, str(exc), trailing_metadata=exc.trailers())

    return wrapper


def bind(server: grpc.aio.Server, listen: str) -> int:
    """Add an insecure port for ``listen`` (HOST:PORT or unix:PATH); clear error if it is taken."""
    try:
        port = server.add_insecure_port(listen)
    except RuntimeError as exc:
        raise InvalidArgument(f"cannot listen on {listen!r}: {exc}; is another rota server running there? "
                              "choose another --listen") from exc
    if port == 0 and not listen.startswith("unix:"):
        raise InvalidArgument(f"cannot listen on {listen!r}: address in use or invalid; choose another --listen")
    return port


async def health_servicer(service_names: tuple[str, ...]) -> health.aio.HealthServicer:
    """grpc.health.v1, SERVING for the whole server ("") and each named service."""
    servicer = health.aio.HealthServicer()
    for name in ("", *service_names):
        await servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    return servicer


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(start: Callable[[], Awaitable[tuple[Any, Callable[[], Awaitable[None]]]]],
                    *, name: str) -> Iterator[tuple[Any, asyncio.AbstractEventLoop]]:
    """Run a server on its own event-loop thread.

    ``start()`` runs on that loop and returns (handle, stop); ``stop()`` is awaited
    there when the block ends. Yields (handle, loop). Start-up errors are raised here.
    """
    loop = asyncio.new_event_loop()
    ready, done = threading.Event(), asyncio.Event()
    holder: dict[str, Any] = {}

    async def main() -> None:
        handle, stop = await start()
        holder["handle"] = handle
        ready.set()
        await done.wait()
        await stop()
        rest = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for t in rest:
            t.cancel()
        await asyncio.gather(*rest, return_exceptions=True)

    def run() -> None:
        try:
            loop.run_until_complete(main())
        except BaseException as exc:  # surface start-up failures to the caller
            holder["error"] = exc
            ready.set()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    ready.wait(30)
    if "error" in holder:
        raise holder["error"]
    try:
        yield holder["handle"], loop
    finally:
        loop.call_soon_threadsafe(done.set)
        thread.join(10)
