"""The controller's health endpoint (``rota k8s controller --health-listen HOST:PORT``), for the kubelet's probes.

``GET /healthz`` answers 200 while every watched namespace had a successful list, watch
event or watch renewal within ``max_age_s`` (a live watch renews at least every
``--watch-timeout``), else 503 with the reason: a controller that lost the API server, or
whose watch loop hangs, is restarted instead of silently releasing no turns. Plain HTTP
on its own port, like the other probes; it says nothing but how long ago that was.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

__all__ = ["serve_health"]


def serve_health(host: str, port: int, out_of_touch_s: Callable[[], float], max_age_s: float) -> ThreadingHTTPServer:
    """Serve ``/healthz`` on ``host:port`` in a daemon thread; returns the server (``shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # http.server's name for the GET handler
            if self.path.split("?", 1)[0] != "/healthz":
                self._answer(404, "not found: GET /healthz\n")
                return
            age = out_of_touch_s()
            if age <= max_age_s:
                self._answer(200, f"ok: the API server was heard from {age:.0f} s ago\n")
            else:
                heard = "never" if age == float("inf") else f"{age:.0f} s ago"
                self._answer(503, f"no list or watch of the API server succeeded within {max_age_s:g} s "
                                  f"(last: {heard})\n")

        def _answer(self, code: int, text: str) -> None:
            body = text.encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:  # the kubelet probes every few seconds: not worth a line
            pass

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="rota-k8s-health", daemon=True).start()
    return server
