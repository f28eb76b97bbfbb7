"""FakeSglangServer: a real HTTP server on loopback that speaks the SGLang routes rota uses.

It is a FAKE, on purpose: SGLang has no CPU install (it pins a CUDA torch and CUDA
kernels), so the adapter is tested against this stand-in of SGLang's documented
endpoints, keeping the state SGLang would keep:

* ``POST /release_memory_occupation`` / ``POST /resume_memory_occupation`` with
  ``{"tags": [...]}`` (omitted/empty = all of ``weights``, ``kv_cache``, ``cuda_graph``);
* ``POST /generate`` and ``POST /v1/completions`` — refused with 503 while anything is
  released, so a test sees any request that reached the engine before its resume;
* ``GET /health``, ``GET /get_server_info`` (``version``), ``POST /update_weights_from_disk``,
  ``POST /flush_cache``; ``GET /fake/calls`` returns every call and the released tags.

Run standalone: ``python sglang_fakes.py --port N [--version 0.5.2]``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import threading
from typing import Any

TAGS = ("weights", "kv_cache", "cuda_graph")


class FakeSglangServer(http.server.ThreadingHTTPServer):
    """Fake of an SGLang server started with --enable-memory-saver."""

    daemon_threads = True

    def __init__(self, port: int = 0, version: str = "0.5.2") -> None:
        super().__init__(("127.0.0.1", port), _Handler)
        self.version = version
        self.released: set[str] = set()
        self.calls: list[str] = []
        self.generated = 0
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def start(self) -> FakeSglangServer:
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self


class _Handler(http.server.BaseHTTPRequestHandler):
    server: FakeSglangServer
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
        if self.path != "/fake/calls":
            srv.calls.append(f"GET {self.path}")
        if self.path == "/health":
            return self._reply(200, {})
        if self.path == "/get_server_info":
            return self._reply(200, {"version": srv.version, "enable_memory_saver": True})
        if self.path == "/fake/calls":
            return self._reply(200, {"calls": srv.calls, "released": sorted(srv.released)})
        return self._reply(404, {"detail": "Not Found"})

    def do_POST(self) -> None:
        srv = self.server
        n = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(n) or b"{}") if n else {}
        srv.calls.append(f"POST {self.path} {json.dumps(body, sort_keys=True)}")
        with srv.lock:
            if self.path in ("/release_memory_occupation", "/resume_memory_occupation"):
                tags = body.get("tags") or list(TAGS)
                bad = [t for t in tags if t not in TAGS]
                if bad:
                    return self._reply(400, {"error": f"unknown tags {bad}"})
                if self.path.startswith("/release"):
                    srv.released |= set(tags)
                else:
                    srv.released -= set(tags)
                return self._reply(200, {})
            if self.path == "/update_weights_from_disk":
                ok = bool(body.get("model_path"))
                return self._reply(200, {"success": ok, "message": "ok" if ok else "model_path missing"})
            if self.path == "/flush_cache":
                return self._reply(200, {})
            if self.path in ("/generate", "/v1/completions"):
                if srv.released:
                    return self._reply(503, {"error": f"memory released ({sorted(srv.released)}): a request "
                                                      "reached the fake while parked"})
                srv.generated += 1
                return self._reply(200, {"text": f" tok{srv.generated}"})
        return self._reply(404, {"detail": "Not Found"})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--version", default="0.5.2")
    a = p.parse_args()
    FakeSglangServer(a.port, a.version).serve_forever()


if __name__ == "__main__":
    main()
