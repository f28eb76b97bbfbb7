"""What the fake engines share: a threaded HTTP server on loopback that records calls, and JSON replies."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator
from typing import Any, TypeVar

Fake = TypeVar("Fake", bound="FakeEngineServer")


class FakeEngineServer(http.server.ThreadingHTTPServer):
    """A fake engine on ``127.0.0.1:port`` (0 = a free port) that reports ``version``.

    ``calls`` lists every request seen (``"POST /sleep?level=1"``), ``generated`` counts
    completions, ``lock`` serializes state changes.
    """

    daemon_threads = True

    def __init__(self, handler: type[JsonHandler], port: int, version: str) -> None:
        super().__init__(("127.0.0.1", port), handler)
        self.version = version
        self.calls: list[str] = []
        self.generated = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self: Fake) -> Fake:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    @contextlib.contextmanager
    def running(self: Fake) -> Iterator[Fake]:
        """``with FakeVllmServer().running() as srv:`` — served in a thread, shut down after."""
        self.start()
        try:
            yield self
        finally:
            self.shutdown()
            self.server_close()


class JsonHandler(http.server.BaseHTTPRequestHandler):
    """HTTP/1.1, silent, with :meth:`reply` sending a JSON body."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def reply(self, code: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)


__all__ = ["FakeEngineServer", "JsonHandler"]
