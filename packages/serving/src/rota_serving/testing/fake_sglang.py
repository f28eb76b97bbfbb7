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

Run standalone: ``python -m rota_serving.testing sglang --port N [--version 0.5.2]``.
"""

from __future__ import annotations

import json

from rota_serving.testing.fake_server import FakeEngineServer, JsonHandler

TAGS = ("weights", "kv_cache", "cuda_graph")


class FakeSglangServer(FakeEngineServer):
    """Fake of an SGLang server started with --enable-memory-saver."""

    def __init__(self, port: int = 0, version: str = "0.5.2") -> None:
        super().__init__(_Handler, port, version)
        self.released: set[str] = set()


class _Handler(JsonHandler):
    server: FakeSglangServer

    def do_GET(self) -> None:
        srv = self.server
        if self.path != "/fake/calls":
            srv.calls.append(f"GET {self.path}")
        if self.path == "/health":
            return self.reply(200, {})
        if self.path == "/get_server_info":
            return self.reply(200, {"version": srv.version, "enable_memory_saver": True})
        if self.path == "/fake/calls":
            return self.reply(200, {"calls": srv.calls, "released": sorted(srv.released)})
        return self.reply(404, {"detail": "Not Found"})

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
                    return self.reply(400, {"error": f"unknown tags {bad}"})
                if self.path.startswith("/release"):
                    srv.released |= set(tags)
                else:
                    srv.released -= set(tags)
                return self.reply(200, {})
            if self.path == "/update_weights_from_disk":
                ok = bool(body.get("model_path"))
                return self.reply(200, {"success": ok, "message": "ok" if ok else "model_path missing"})
            if self.path == "/flush_cache":
                return self.reply(200, {})
            if self.path in ("/generate", "/v1/completions"):
                if srv.released:
                    return self.reply(503, {"error": f"memory released ({sorted(srv.released)}): a request "
                                                      "reached the fake while parked"})
                srv.generated += 1
                return self.reply(200, {"text": f" tok{srv.generated}"})
        return self.reply(404, {"detail": "Not Found"})


__all__ = ["FakeSglangServer"]
