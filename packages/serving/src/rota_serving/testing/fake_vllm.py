"""FakeVllmServer: a real HTTP server on loopback that speaks the vLLM routes rota uses.

It is a FAKE, on purpose: vLLM's sleep mode does nothing on CPU (and vLLM is not in
the fast test tier's environment), so the serving protocol and turn logic are
tested against this stand-in, which keeps the state that vLLM would keep:

* ``POST /sleep?level=1|2`` → asleep (level kept); ``POST /wake_up[?tags=weights&tags=kv_cache]``
  wakes those tags, awake once every tag is back; ``GET /is_sleeping``;
* ``POST /v1/completions`` (plain or ``"stream": true`` SSE) — refused with 503 while
  asleep, so a test sees any request that reached the engine before its wake-up;
* ``GET /health``, ``GET /version`` (``--version``), ``POST /collective_rpc``,
  ``POST /reset_prefix_cache``; ``GET /fake/calls`` returns every call seen, in order.

The real engine is exercised by rota-adapter-vllm's heavy tier (``test_vllm_heavy.py``).
Run standalone: ``python -m rota_serving.testing vllm --port N [--version 0.32.0]``.
"""

from __future__ import annotations

import json
import urllib.parse

from rota_serving.testing.fake_server import FakeEngineServer, JsonHandler

TAGS = ("weights", "kv_cache")


class FakeVllmServer(FakeEngineServer):
    """Fake of a vLLM OpenAI server started with --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1."""

    def __init__(self, port: int = 0, version: str = "0.32.0") -> None:
        super().__init__(_Handler, port, version)
        self.asleep: set[str] = set()
        self.level = 0


class _Handler(JsonHandler):
    server: FakeVllmServer

    def do_GET(self) -> None:
        srv = self.server
        path = urllib.parse.urlsplit(self.path).path
        if path != "/fake/calls":
            srv.calls.append(f"GET {self.path}")
        if path == "/health":
            return self.reply(200, {})
        if path == "/version":
            return self.reply(200, {"version": srv.version})
        if path == "/is_sleeping":
            return self.reply(200, {"is_sleeping": bool(srv.asleep)})
        if path == "/v1/models":
            return self.reply(200, {"data": [{"id": "fake"}]})
        if path == "/fake/calls":
            return self.reply(200, {"calls": srv.calls, "asleep": sorted(srv.asleep), "level": srv.level})
        return self.reply(404, {"detail": "Not Found"})

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
                    return self.reply(400, {"detail": f"level {level} is not 1 or 2"})
                srv.asleep, srv.level = set(TAGS), int(level)
                return self.reply(200, {})
            if u.path == "/wake_up":
                tags = q.get("tags", list(TAGS))
                bad = [t for t in tags if t not in TAGS]
                if bad:
                    return self.reply(400, {"detail": f"unknown tags {bad}"})
                srv.asleep -= set(tags)
                if not srv.asleep:
                    srv.level = 0
                return self.reply(200, {})
            if u.path == "/collective_rpc":
                body = json.loads(raw or b"{}")
                return self.reply(200, {"results": [{"method": body.get("method"), "args": body.get("args")}]})
            if u.path == "/reset_prefix_cache":
                return self.reply(200, {})
            if u.path == "/v1/completions":
                if srv.asleep:
                    return self.reply(503, {"error": "engine is asleep (fake: a request reached it while parked)"})
                body = json.loads(raw or b"{}")
                srv.generated += 1
                text = f" tok{srv.generated}"
                if body.get("stream"):
                    return self._stream(text)
                return self.reply(200, {"object": "text_completion", "choices": [{"index": 0, "text": text}]})
        return self.reply(404, {"detail": "Not Found"})

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


__all__ = ["FakeVllmServer"]
