"""FakeVllmServer: a real HTTP server on loopback that speaks the vLLM routes rota uses.

It is a FAKE, on purpose: vLLM's sleep mode does nothing on CPU (and vLLM is not in
the fast test tier's environment), so the adapter's protocol and turn logic are
tested against this stand-in, which keeps the state that vLLM would keep:

* ``POST /sleep?level=1|2`` → asleep (level kept); ``POST /wake_up[?tags=weights&tags=kv_cache]``
  wakes those tags, awake once every tag is back; ``GET /is_sleeping``;
* ``POST /v1/completions`` (plain or ``"stream": true`` SSE) — refused with 503 while
  asleep, so a test sees any request that reached the engine before its wake-up;
* ``GET /health``, ``GET /version`` (``--version``), ``POST /collective_rpc``,
  ``POST /reset_prefix_cache``; ``GET /fake/calls`` returns every call seen, in order.

The real engine is exercised by the heavy tier (``test_vllm_heavy.py``).
Run standalone: ``python vllm_fakes.py --port N [--version 0.32.0]``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import urllib.parse
from typing import Any

TAGS = ("weights", "kv_cache")


class FakeVllmServer(http.server.ThreadingHTTPServer):
    """Fake of a vLLM OpenAI server started with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1."""

    daemon_threads = True

    def __init__(self, port: int = 0, version: str = "0.32.0") -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.version = version
        self.asleep: set[str] = set()
        self.level = 0
        self.calls: list[str] = []
        self.generated = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> FakeVllmServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeVllmServer
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _reply(self, code: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        srv = self.server
        path = urllib.parse.urlsplit(self.path).path
        if path != "/fake/calls":
            srv.calls.append(f"GET {self.path}")
        if path == "/health":
            return self._reply(200, {})
        if path == "/version":
            return self._reply(200, {"version": srv.version})
        if path == "/is_sleeping":
            return self._reply(200, {"is_sleeping": bool(srv.asleep)})
        if path == "/v1/models":
            return self._reply(200, {"data": [{"id": "fake"}]})
        if path == "/fake/calls":
            return self._reply(200, {"calls": srv.calls, "asleep": sorted(srv.asleep), "level": srv.level})
        return self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        srv = self.server
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        u = urllib.parse.urlsplit(self.path)
        q = urllib.parse.parse_qs(u.query)
        srv.calls.append(f"POST {self.path}")
        with srv.lock:
            if u.path == "/sleep":
                level = q.get("level", ["1"])[0]
                if level not in ("1", "2"):
                    return self._reply(400, {"detail": f"level {level} is not 1 or 2"})
                srv.asleep, srv.level = set(TAGS), int(level)
                return self._reply(200, {})
            if u.path == "/wake_up":
                tags = q.get("tags", list(TAGS))
                bad = [t for t in tags if t not in TAGS]
                if bad:
                    return self._reply(400, {"detail": f"unknown tags {bad}"})
                srv.asleep -= set(tags)
                if not srv.asleep:
                    srv.level = 0
                return self._reply(200, {})
            if u.path == "/collective_rpc":
                body = json.loads(raw or b"{}")
                return self._reply(200, {"results": [{"method": body.get("method"), "args": body.get("args")}]})
            if u.path == "/reset_prefix_cache":
                return self._reply(200, {})
            if u.path == "/v1/completions":
                if srv.asleep:
                    return self._reply(503, {"error": "engine is asleep (fake: a request reached it while parked)"})
                body = json.loads(raw or b"{}")
                srv.generated += 1
                text = f" tok{srv.generated}"
                if body.get("stream"):
                    return self._stream(text)
                return self._reply(200, {"object": "text_completion", "choices": [{"index": 0, "text": text}]})
        return self._reply(404, {"detail": "Not Found"})

    def _stream(self, text: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for piece in (*text.split(), "[DONE]"):
            data = piece if piece == "[DONE]" else json.dumps({"choices": [{"text": piece}]})
            chunk = f"data: {data}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        self.wfile.write(b"0\r\n\r\n")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--version", default="0.32.0")
    a = p.parse_args()
    FakeVllmServer(a.port, a.version).serve_forever()


if __name__ == "__main__":
    main()
