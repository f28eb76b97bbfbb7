"""The HTTP front end: uvicorn (h11) on one event loop, the routes' handlers on a small thread pool.

Why not a thread per socket: a peer that opens connections and never finishes a request
held one thread each (1,500 half-sent requests held 1,513 threads and starved
``/healthz``). Here an idle or half-sent connection costs the event loop a few objects
and no thread, and is bounded three ways:

* ``max_connections``: uvicorn's ``limit_concurrency``; past it, requests get 503; below
  it, :class:`rota_tinker._http.gate.Gate` caps each peer's connections, those that have
  shown no API key yet and those of each key, so neither a slow or keyless client nor a
  tenant with many half-sent requests can take another tenant's place, and slows wrong keys;
* a **head deadline**: each request's head (request line and headers) must arrive within
  ``header_timeout_s`` of the connection opening (or of the previous response), dribbled
  or not, else the connection is closed. uvicorn has no such timeout (its keep-alive timer
  restarts on every byte received: Kludex/uvicorn#157), so :class:`_Protocol` adds one;
* a **body deadline**: :meth:`Request.body` reads at most the declared ``Content-Length``
  within ``body_timeout_s`` (408 past it).

Handlers decide who is calling from the headers before any body is read; an answer
given without reading the body closes the connection (``Connection: close``), so a
refused upload is never read. Used by :mod:`rota_tinker._http.service`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import resource
import socket
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from rota_tinker._http.formats import BadRequest
from rota_tinker._http.gate import Gate

log = logging.getLogger(__name__)


@dataclass
class Reply:
    """An HTTP answer."""

    status: int
    body: bytes
    content_type: str = "application/json"
    headers: tuple[tuple[bytes, bytes], ...] = ()

    @classmethod
    def json(cls, obj: Any, status: int = 200) -> Reply:
        return cls(status, json.dumps(obj).encode())


@dataclass
class Request:
    """One request as handlers see it: method, path, headers (names lower-case), and its body once read."""

    method: str
    path: str
    headers: dict[str, bytes]
    receive: Callable[[], Awaitable[dict[str, Any]]]
    body_read: bool = False
    data: bytes = field(default=b"", repr=False)
    query: str = ""  # the raw query string (listing routes read limit and offset from it)

    def header(self, name: str) -> str:
        return self.headers.get(name, b"").decode("latin-1")

    async def body(self, limit: int, timeout_s: float) -> bytes:
        """The body, at most ``limit`` bytes (413 before reading when the declared length is more); 408 when it
        does not arrive within ``timeout_s``."""
        if self.header("transfer-encoding"):
            raise BadRequest("chunked bodies are not supported; send Content-Length", status=411)
        raw = self.header("content-length")
        if not raw:
            self.body_read = True
            return b""
        if not re.fullmatch(r"[0-9]{1,18}", raw):
            raise BadRequest("Content-Length is not a non-negative integer")
        declared = int(raw)
        if declared > limit:
            raise BadRequest(f"body of {declared} bytes is over this route's limit of {limit}; send less per "
                             "request", status=413)
        chunks: list[bytes] = []
        got = 0

        async def read() -> None:
            nonlocal got
            while got < declared:
                msg = await self.receive()
                if msg["type"] == "http.disconnect":
                    raise ConnectionResetError("the client went away while sending its body")
                chunk = msg.get("body", b"")
                chunks.append(chunk)
                got += len(chunk)
                if not msg.get("more_body", False):
                    break

        try:
            await asyncio.wait_for(read(), timeout_s)
        except asyncio.TimeoutError:
            raise BadRequest(f"the body did not arrive within {timeout_s:g} s ({got} of {declared} bytes); send "
                             "it faster or in smaller requests", status=408) from None
        self.body_read = True
        self.data = b"".join(chunks)
        return self.data


App = Callable[[Request], Awaitable[Reply]]


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for each request's head (see the module docstring)."""

    header_timeout_s = 10.0  # set per server by HttpServer, with:
    gate: Gate
    is_key: Callable[[bytes], bool] = staticmethod(lambda key: False)  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_deadline: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        peer = transport.get_extra_info("peername")
        self._peer = str(peer[0]) if peer else "unknown"
        self._admitted = self.gate.admit(self, transport, self._peer)
        if not self._admitted:
            transport.close()
            return
        self._arm()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole request head arrived
            self._disarm()
            key = next((v for k, v in getattr(self, "scope", {}).get("headers", ()) if k == b"x-api-key"), b"")
            if key and self.is_key(key) and not self.gate.keyed(self, key):
                self.transport.close()  # that key holds its cap of connections already

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # the next request's head, on a kept-alive connection

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if getattr(self, "_admitted", False):
            self._admitted = False
            self.gate.left(self, self._peer)
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._head_deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _expired(self) -> None:
        self._head_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            log.debug("closing a connection whose request head did not arrive within %g s", self.header_timeout_s)
            self.transport.close()


class HttpServer:
    """Serves ``app`` on ``host:port`` (bound at once, so the port is known and a taken port fails here)."""

    def __init__(self, app: App, host: str, port: int, *, max_connections: int, header_timeout_s: float,
                 body_timeout_s: float, max_client_connections: int | None = None,
                 max_unauthenticated: int | None = None, max_key_connections: int | None = None,
                 is_key: Callable[[bytes], bool] | None = None,
                 tls_cert: str = "", tls_key: str = "") -> None:
        """``is_key(raw header)``: whether an ``X-API-Key`` is known (connections that show one are never evicted;
        a wrong one is slowed); ``tls_cert``/``tls_key``: serve HTTPS (PEM files)."""
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.tls = bool(tls_cert)
        self.gate = Gate(max_client_connections or max_connections, max_unauthenticated or max_connections,
                         max_key_connections or max_connections)
        self.is_key = is_key
        _descriptors_for(max_connections)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family, backlog=min(4096, max_connections))
        protocol = type("_Protocol", (_Protocol,), {"header_timeout_s": header_timeout_s, "gate": self.gate,
                                                    **({"is_key": staticmethod(is_key)} if is_key else {})})
        tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert else {}
        config = uvicorn.Config(self._asgi, http=protocol, interface="asgi3", lifespan="off", log_config=None,
                                **tls,  # type: ignore[arg-type]
                                access_log=False, proxy_headers=False, server_header=False, date_header=False,
                                limit_concurrency=max_connections, backlog=min(4096, max_connections),
                                timeout_keep_alive=5, timeout_graceful_shutdown=2, h11_max_incomplete_event_size=16384)
        self.server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.sock.getsockname()[:2]
        return host, port

    async def _asgi(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        headers: dict[str, bytes] = {}
        for name, value in scope["headers"]:
            key = name.decode("latin-1").lower()
            if key in headers and key in ("x-api-key", "content-length", "content-type", "content-encoding"):
                reply = Reply.json({"detail": f"header {key} is given twice; send it once", "status": 400}, 400)
                await _send(send, reply, close=True)
                return
            headers[key] = value
        request = Request(scope["method"], scope["path"], headers, receive,
                          query=scope.get("query_string", b"").decode("latin-1")[:1024])
        key = headers.get("x-api-key")
        if key and self.is_key is not None and not self.is_key(key):  # logged and slowed, then refused (401)
            client = scope.get("client")
            await asyncio.sleep(self.gate.failed(str(client[0]) if client else "unknown"))
        try:
            reply = await self.app(request)
        except BadRequest as e:
            log.info("%s %s -> %d: %s", request.method, request.path, e.status, e)
            reply = Reply.json({"detail": str(e), "status": e.status}, e.status)
            if e.status == 429:  # a quota: retrying soon does not help (submissions the SDK retries regardless
                # answer a failed future instead: rota_tinker._http.service.REFUSED_AS_FUTURES)
                reply.headers = ((b"x-should-retry", b"false"),)
        except ConnectionResetError:
            log.debug("client went away during %s", request.path)
            return
        # an answer given before the body was read closes the connection: the rest of an upload is never read
        await _send(send, reply, close=not request.body_read)

    def serve_forever(self) -> None:
        """Serve in this thread until :meth:`shutdown` (or SIGINT/SIGTERM in the main thread)."""
        self.server.run(sockets=[self.sock])

    def start(self) -> None:
        self._thread = threading.Thread(target=self.serve_forever, name="rota-tinker-http", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(10)
        self.sock.close()


def _descriptors_for(connections: int) -> None:
    """Raise this process's open-file limit to fit ``connections`` (plus workers' pipes), up to the hard limit."""
    want = connections + 512
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < want:
            log.warning("open files are limited to %d (hard limit): fewer than max_connections=%d can be served; "
                        "lower --max-connections or raise the limit (ulimit -Hn)", new, connections)


async def _send(send: Any, reply: Reply, *, close: bool) -> None:
    headers = [(b"content-type", reply.content_type.encode()), (b"content-length", str(len(reply.body)).encode()),
               *reply.headers]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": reply.status, "headers": headers})
    await send({"type": "http.response.body", "body": reply.body})
