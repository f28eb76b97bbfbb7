"""FakePortForwardApi: a SMALL FAKE of the Kubernetes API server's pod list and ``pods/portforward``.

No real API server (nor kubelet) can run on the test machines, so this serves, over
real HTTP and WebSocket on loopback (aiohttp, which the kubernetes client already
depends on), exactly what ``kubectl rota status`` uses through the official client:

* ``GET /api/v1/namespaces/{ns}/pods?labelSelector=...`` — a PodList of the pods given
  to it (``key=value`` terms only), each Running with a Ready condition as given;
* ``GET /api/v1/namespaces/{ns}/pods/{name}/portforward?ports=P`` — a WebSocket with
  subprotocol ``v4.channel.k8s.io``: the initial port frames on the data (0) and error
  (1) channels, then channel-0 frames carried both ways to a real TCP address (the
  "pod's" port: in the tests a real orchestrator on loopback). A pod without such an
  address gets an error-channel message, as the kubelet sends for a refused port.

Nothing else: no authentication, no other resources, one port per stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

from aiohttp import WSMsgType, web

PROTOCOL = "v4.channel.k8s.io"


class FakePortForwardApi:
    """Pods (name -> (ready, {port: 'host:port'})) in one namespace, listable and port-forwardable."""

    def __init__(self, namespace: str, pods: dict[str, tuple[bool, dict[int, str]]],
                 labels: dict[str, str]) -> None:
        self.namespace, self.pods, self.labels = namespace, pods, labels
        self.forwards: list[tuple[str, int]] = []  # (pod, port) of each stream opened
        self._loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._streams: dict[int, web.Request] = {}  # open port-forward requests, by id
        self.port = 0

    def __enter__(self) -> FakePortForwardApi:
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        started.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        async def stop() -> None:
            # a client may leave its port-forward open (an idle gRPC connection): drop each stream's connection
            # first, or the runner's cleanup waits for its handler (aiohttp's graceful shutdown: 60 s)
            for request in list(self._streams.values()):
                if request.transport is not None:
                    request.transport.abort()
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/portforward", self._forward)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        started.set()
        self._loop.run_forever()

    async def _list(self, request: web.Request) -> web.Response:
        ns = request.match_info["ns"]
        terms = dict(t.split("=", 1) for t in request.query.get("labelSelector", "").split(",") if "=" in t)
        match = ns == self.namespace and all(self.labels.get(k) == v for k, v in terms.items())
        items = [{"metadata": {"name": name, "namespace": ns, "labels": self.labels},
                  "status": {"phase": "Running",
                             "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}
                 for name, (ready, _) in self.pods.items()] if match else []
        return web.json_response({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"},
                                  "items": items})

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        self._streams[id(request)] = request
        try:
            return await self._stream(request)
        finally:
            self._streams.pop(id(request), None)

    async def _stream(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        port = int(request.query["ports"])
        ws = web.WebSocketResponse(protocols=(PROTOCOL,))
        await ws.prepare(request)
        head = port.to_bytes(2, "little")
        await ws.send_bytes(b"\x00" + head)
        await ws.send_bytes(b"\x01" + head)
        self.forwards.append((name, port))
        target = self.pods.get(name, (False, {}))[1].get(port)
        if target is None:
            await ws.send_bytes(b"\x01" + f"pod {name} does not listen on {port}".encode())
            await ws.close()
            return ws
        host, _, tport = target.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(tport))

        async def pod_to_client() -> None:
            while chunk := await reader.read(65536):
                await ws.send_bytes(b"\x00" + chunk)
            await ws.close()

        back = asyncio.create_task(pod_to_client())
        async for msg in ws:
            if msg.type == WSMsgType.BINARY and msg.data[:1] == b"\x00":
                writer.write(msg.data[1:])
                await writer.drain()
            elif msg.type in (WSMsgType.CLOSE, WSMsgType.ERROR):
                break
        writer.close()
        back.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await back
        return ws


def kubeconfig(path: Any, server: str) -> str:
    """A kubeconfig file pointing at ``server`` (no credentials: the fake checks none)."""
    path.write_text(f"""apiVersion: v1
kind: Config
clusters: [{{name: fake, cluster: {{server: "{server}"}}}}]
users: [{{name: me, user: {{}}}}]
contexts: [{{name: fake, context: {{cluster: fake, user: me}}}}]
current-context: fake
""")
    return str(path)

