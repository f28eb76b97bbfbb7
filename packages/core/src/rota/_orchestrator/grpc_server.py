"""What every rota gRPC server shares: error mapping, binding, health, a thread to run in.

Used by the orchestrator (:mod:`rota._orchestrator.service`, :mod:`rota._orchestrator.inproc`) and by the node
agent (``rota_agent``), so both map :class:`rota.errors.RotaError` to the status codes
of the v1alpha1 API the same way and fail the same way on a bad ``--listen``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from rota.errors import InvalidArgument, RotaError

log = logging.getLogger(__name__)


class BadMessage:
    """A request that could not be parsed (e.g. invalid UTF-8 in a string field): refused as INVALID_ARGUMENT."""

    def __init__(self, why: str) -> None:
        self.why = why

    def error(self) -> InvalidArgument:
        return InvalidArgument(f"the request could not be parsed ({self.why}); string fields must be UTF-8")


def _lenient(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as exc:  # protobuf's DecodeError and friends: the handler refuses it clearly
            return BadMessage(type(exc).__name__)

    return parse_or_mark


class LenientRequests(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Hands unparsable requests to the handler as :class:`BadMessage` (gRPC itself answers UNKNOWN)."""

    async def intercept_service(self, continuation: Callable[..., Awaitable[Any]], details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return handler._replace(request_deserializer=_lenient(handler.request_deserializer))


REFUSALS_LOGGED_PER_MINUTE = 20  # a caller hammering with bad tokens cannot flood the log
SETTLE_S = 2.0  # how long the tasks left after a server stopped get to end on their own before they are cancelled
_refusals = {"window": 0.0, "logged": 0, "dropped": 0}


def log_refusal(method: str, context: grpc.aio.ServicerContext, exc: RotaError) -> None:
    """A refused credential (UNAUTHENTICATED) or action (PERMISSION_DENIED) is logged as a warning with the
    caller's address, at most :data:`REFUSALS_LOGGED_PER_MINUTE` lines a minute (then how many were not)."""
    if exc.code not in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return
    now = time.monotonic()
    if now - _refusals["window"] >= 60:
        if _refusals["dropped"]:
            log.warning("%d more refused calls in the last minute were not logged", _refusals["dropped"])
        _refusals.update(window=now, logged=0, dropped=0)
    if _refusals["logged"] >= REFUSALS_LOGGED_PER_MINUTE:
        _refusals["dropped"] += 1
        return
    _refusals["logged"] += 1
    log.warning("refused %s from %s: %s", method, context.peer() or "?", exc)


def rpc_errors(fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """Decorate a servicer method: a RotaError aborts the RPC with its code and message (refused credentials
    are logged: :func:`log_refusal`); an unparsable request (:class:`BadMessage`) is INVALID_ARGUMENT."""

    @functools.wraps(fn)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            if isinstance(request, BadMessage):
                raise request.error()
            return await fn(self, request, context)
        except RotaError as exc:
            log_refusal(fn.__name__, context, exc)
            await context.abort(exc.code, str(exc), trailing_metadata=exc.trailers())

    return wrapper


def server_tls(cert: str, key: str, client_ca: str = "") -> grpc.ServerCredentials:
    """TLS for a server from PEM files; with ``client_ca`` every client must present a certificate it signed."""
    from rota.auth import read_pem

    return grpc.ssl_server_credentials([(read_pem(key, "--tls-key"), read_pem(cert, "--tls-cert"))],
                                       root_certificates=read_pem(client_ca, "--tls-client-ca") if client_ca else None,
                                       require_client_auth=bool(client_ca))


def bind(server: grpc.aio.Server, listen: str, credentials: grpc.ServerCredentials | None = None) -> int:
    """Add a port for ``listen`` (HOST:PORT or unix:PATH), TLS when ``credentials``; clear error if it is taken."""
    try:
        port = server.add_secure_port(listen, credentials) if credentials else server.add_insecure_port(listen)
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
        rest = {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}
        if rest:  # the server's RPC tasks end on their own once stop() has cancelled their calls: cancelled from here
            # instead, grpc's wrapper of a stream still ending (an Attach detaching its tenant) logs a CancelledError
            # traceback (seen at Ctrl-C of `rota demo`)
            _, rest = await asyncio.wait(rest, timeout=SETTLE_S)
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
