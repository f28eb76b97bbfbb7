"""The proxy in front of a served engine: each request that needs the GPU runs inside a turn.

Who calls it: ``serve_app`` starts one :class:`TurnProxy` on ``--listen`` per served
engine. Paths in ``free_paths`` (health, metrics, model list) are forwarded without a
turn; the engine's own sleep/wake routes are refused (409) so that only rota moves the
engine's memory. Streamed answers (SSE) are relayed chunk by chunk.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading
import urllib.parse
from typing import Any

from rota.errors import RotaError
from rota_serving.endpoint import check_base_url, open_connection
from rota_serving.engines import CONTROL_PATHS, FREE_PATHS
from rota_serving.gate import TurnGate

log = logging.getLogger(__name__)

_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                  "transfer-encoding", "upgrade", "content-length", "host"})


class TurnProxy(http.server.ThreadingHTTPServer):
    """An HTTP reverse proxy to ``upstream`` that runs each GPU request inside a turn."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, listen: tuple[str, int], upstream: str, gate: TurnGate, *, app: str,
                 request_timeout_s: float = 600.0, free_paths: frozenset[str] = FREE_PATHS) -> None:
        self.upstream = check_base_url(upstream, "upstream")
        self.gate, self.app, self.request_timeout_s, self.free_paths = gate, app, request_timeout_s, free_paths
        super().__init__(listen, _ProxyHandler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def start(self) -> TurnProxy:
        threading.Thread(target=self.serve_forever, name="rota-proxy", daemon=True).start()
        return self


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: TurnProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("proxy: " + fmt, *args)

    def _error(self, code: int, message: str) -> None:
        raw = json.dumps({"error": {"message": message, "type": "rota", "code": code}}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _handle(self) -> None:
        length = self.headers.get("Content-Length")
        try:
            n = int(length) if length else 0
        except ValueError:
            return self._error(400, f"Content-Length {length!r} is not a number")
        body = self.rfile.read(n) if n else None
        path = urllib.parse.urlsplit(self.path).path
        if path in CONTROL_PATHS:
            return self._error(409, f"{path} is managed by rota (the engine sleeps and wakes with its turns); "
                                    "use `rota` to park it, or call the engine's own port directly")
        if path in self.server.free_paths:
            return self._forward(body)
        try:
            self.server.gate.enter()
        except RotaError as exc:
            return self._error(503, f"could not get a turn for {self.server.gate.gpu.tenant!r}: {exc}")
        try:
            self._forward(body)
        finally:
            self.server.gate.exit()

    def _forward(self, body: bytes | None) -> None:
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        try:
            conn = open_connection(self.server.upstream, self.server.request_timeout_s)
            conn.request(self.command, self.path, body=body, headers=headers)
            resp = conn.getresponse()
        except OSError as exc:
            return self._error(502, f"{self.server.app} server at {self.server.upstream} failed: {exc}")
        try:
            self.send_response(resp.status, resp.reason)
            for k, v in resp.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            size = resp.getheader("Content-Length")
            if size is not None:
                self.send_header("Content-Length", size)
                self.end_headers()
                self.wfile.write(resp.read())
                return
            self.send_header("Transfer-Encoding", "chunked")  # streamed (SSE): relay chunk by chunk
            self.end_headers()
            while chunk := resp.read1(65536):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            conn.close()

    do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _handle


__all__ = ["TurnProxy"]
