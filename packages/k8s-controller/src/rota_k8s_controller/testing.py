"""FakeKubeApi: a SMALL FAKE of the Kubernetes API server, for tests of the controller and of
``rota k8s tenant --check-claim``.

No real API server can run on the test machines, so this serves exactly the
endpoints rota_k8s_controller and rota_k8s use through the official ``kubernetes``
client, over real HTTP on loopback:

* ``GET /api/v1/pods`` and ``GET /api/v1/namespaces/{ns}/pods`` — a PodList, filtered
  by ``labelSelector`` (``key`` and ``key=value`` terms only), with a resourceVersion;
* the same with ``watch=true`` — a chunked stream of ``{"type", "object"}`` lines for
  changes after ``resourceVersion``, ended after ``timeoutSeconds``; a resourceVersion
  older than the kept history gets an ERROR event with code 410 (Gone), as the real
  server answers after compaction;
* ``GET /apis/resource.k8s.io/v1/namespaces/{ns}/resourceclaims/{name}`` — one
  ResourceClaim as stored, or a 404 Status (``rota k8s tenant --check-claim``);
* ``POST /api/v1/namespaces/{ns}/secrets``, ``PUT`` and ``DELETE .../secrets/{name}`` —
  the controller's job-token Secrets: 409 AlreadyExists on a second create, 404 on a
  missing one, and 403 Forbidden outside :attr:`secret_namespaces` (a stand-in for the
  controller's Roles: RBAC itself is not emulated). There is no GET of a Secret: the
  controller may not read them; tests look at :attr:`secrets`.

Pods, claims and Secrets are plain dicts; tests change them with :meth:`create_pod`,
:meth:`update_pod`, :meth:`delete_pod` and :meth:`put_claim`. It is not a general
fake: no other resources or verbs, no authentication, no field selectors, no
server-side apply.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

__all__ = ["FakeKubeApi"]

Pod = dict[str, Any]


def _matches(selector: str, labels: dict[str, str]) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        key, sep, value = term.partition("=")
        if sep:
            if labels.get(key) != value.lstrip("="):
                return False
        elif key not in labels:
            return False
    return True


class FakeKubeApi:
    """Pods in memory, served as list and watch over HTTP on 127.0.0.1."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.rv = 100
        self.pods: dict[tuple[str, str], Pod] = {}
        self.claims: dict[tuple[str, str], dict[str, Any]] = {}
        self.secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self.secret_namespaces: set[str] | None = None  # None: writes allowed everywhere
        self.secret_writes: list[tuple[str, str, str]] = []  # (verb, namespace, name) done, for tests
        self.secret_refusals: list[tuple[str, str, str]] = []  # (verb, namespace, name) answered 403
        self.history: list[tuple[int, str, Pod]] = []
        self.oldest_rv = self.rv  # watches from before this get 410 Gone
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.closed = False
        self.fail_next_lists = 0  # answer this many list requests with 500
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                fake._serve(self)

            def do_POST(self) -> None:
                fake._write_secret(self, "POST")

            def do_PUT(self) -> None:
                fake._write_secret(self, "PUT")

            def do_DELETE(self) -> None:
                fake._write_secret(self, "DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-kube-api", daemon=True)

    # ------------------------------------------------------------ lifecycle

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> FakeKubeApi:
        self.thread.start()
        return self

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(10)

    # -------------------------------------------------------------- pods

    def _record(self, kind: str, pod: Pod) -> None:
        self.rv += 1
        pod["metadata"]["resourceVersion"] = str(self.rv)
        self.history.append((self.rv, kind, copy.deepcopy(pod)))
        self.cond.notify_all()

    def create_pod(self, name: str, *, namespace: str = "default", labels: dict[str, str] | None = None,
                   phase: str = "Running", node: str = "gpu-node-1",
                   owner: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> Pod:
        with self.cond:
            pod: Pod = {"apiVersion": "v1", "kind": "Pod",
                        "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                                     "labels": dict(labels or {}),
                                     **({"ownerReferences": [dict(owner, controller=True)]} if owner else {})},
                        "spec": {"nodeName": node, "containers": [{"name": "tenant", "image": "tenant:1", **(
                            {"env": [{"name": k, "value": v} for k, v in env.items()]} if env else {})}]},
                        "status": {"phase": phase}}
            self.pods[(namespace, name)] = pod
            self._record("ADDED", pod)
            return copy.deepcopy(pod)

    def update_pod(self, name: str, change: Callable[[Pod], None], *, namespace: str = "default") -> Pod:
        with self.cond:
            pod = self.pods[(namespace, name)]
            change(pod)
            self._record("MODIFIED", pod)
            return copy.deepcopy(pod)

    def delete_pod(self, name: str, *, namespace: str = "default") -> None:
        with self.cond:
            pod = self.pods.pop((namespace, name))
            self._record("DELETED", pod)

    def put_claim(self, claim: dict[str, Any]) -> None:
        """Store a ResourceClaim (as ``kubectl apply`` would have created it)."""
        with self.cond:
            meta = claim["metadata"]
            self.claims[(meta.get("namespace", "default"), meta["name"])] = copy.deepcopy(claim)

    def secret(self, name: str, namespace: str = "default") -> dict[str, Any] | None:
        """A stored Secret (a copy), or None."""
        with self.cond:
            return copy.deepcopy(self.secrets.get((namespace, name)))

    def compact(self) -> None:
        """Forget the event history: watches from an older resourceVersion get 410 Gone."""
        with self.cond:
            self.history.clear()
            self.oldest_rv = self.rv
            self.cond.notify_all()

    def watch_count(self) -> int:
        return sum(1 for _, q in self.requests if q.get("watch") in ("true", "True", "1"))

    # ------------------------------------------------------------- HTTP side

    def _serve(self, h: BaseHTTPRequestHandler) -> None:
        url = urlparse(h.path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        with self.cond:
            self.requests.append((url.path, query))
        parts = url.path.strip("/").split("/")
        if len(parts) == 7 and parts[:4] == ["apis", "resource.k8s.io", "v1", "namespaces"] \
                and parts[5] == "resourceclaims":
            with self.cond:
                claim = copy.deepcopy(self.claims.get((parts[4], parts[6])))
            if claim is None:
                self._status(h, 404, "NotFound", f'resourceclaims.resource.k8s.io "{parts[6]}" not found')
            else:
                self._json(h, 200, claim)
            return
        if parts == ["api", "v1", "pods"]:
            namespace = ""
        elif len(parts) == 5 and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "pods":
            namespace = parts[3]
        else:
            self._status(h, 404, "NotFound", f"FakeKubeApi does not serve {url.path}")
            return
        selector = query.get("labelSelector", "")

        def wanted(pod: Pod) -> bool:
            meta = pod["metadata"]
            return (not namespace or meta["namespace"] == namespace) and _matches(selector, meta["labels"])

        if query.get("watch") in ("true", "True", "1"):
            self._watch(h, wanted, int(query.get("resourceVersion") or 0), float(query.get("timeoutSeconds", 30)))
            return
        with self.cond:
            if self.fail_next_lists > 0:
                self.fail_next_lists -= 1
                self._status(h, 500, "InternalError", "injected by FakeKubeApi")
                return
            items = [copy.deepcopy(p) for p in self.pods.values() if wanted(p)]
            body = {"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": str(self.rv)},
                    "items": items}
        self._json(h, 200, body)

    @staticmethod
    def _status(h: BaseHTTPRequestHandler, code: int, reason: str, message: str) -> None:
        FakeKubeApi._json(h, code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                    "reason": reason, "message": message})

    def _write_secret(self, h: BaseHTTPRequestHandler, verb: str) -> None:
        """POST/PUT/DELETE of a Secret, as the real server answers them (minus RBAC and validation)."""
        url = urlparse(h.path)
        parts = url.path.strip("/").split("/")
        length = int(h.headers.get("Content-Length") or 0)
        body = json.loads(h.rfile.read(length) or b"{}") if length else {}
        if not (len(parts) in (5, 6) and parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "secrets"
                and (len(parts) == 6) == (verb != "POST")):
            self._status(h, 405, "MethodNotAllowed", f"FakeKubeApi does not serve {verb} {url.path}")
            return
        ns = parts[3]
        name = parts[5] if len(parts) == 6 else (body.get("metadata") or {}).get("name", "")
        with self.cond:
            if self.secret_namespaces is not None and ns not in self.secret_namespaces:
                self.secret_refusals.append((verb, ns, name))
                self._status(h, 403, "Forbidden", f'secrets "{name}" is forbidden: cannot {verb.lower()} '
                             f'resource "secrets" in the namespace "{ns}"')
                return
            exists = (ns, name) in self.secrets
            if verb == "POST" and exists:
                self._status(h, 409, "AlreadyExists", f'secrets "{name}" already exists')
                return
            if verb in ("PUT", "DELETE") and not exists:
                self._status(h, 404, "NotFound", f'secrets "{name}" not found')
                return
            self.secret_writes.append((verb, ns, name))
            if verb == "DELETE":
                del self.secrets[(ns, name)]
                self._json(h, 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"})
                return
            self.rv += 1
            body.setdefault("metadata", {}).update(namespace=ns, resourceVersion=str(self.rv))
            self.secrets[(ns, name)] = copy.deepcopy(body)
        self._json(h, 201 if verb == "POST" else 200, body)

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, code: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        h.send_response(code)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(data)))
        h.end_headers()
        h.wfile.write(data)

    def _watch(self, h: BaseHTTPRequestHandler, wanted: Callable[[Pod], bool], since: int, timeout: float) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()

        def chunk(obj: dict[str, Any] | None) -> None:
            data = b"" if obj is None else json.dumps(obj).encode() + b"\n"
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        deadline = time.monotonic() + timeout
        try:
            with self.cond:
                if since < self.oldest_rv:
                    gone = {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 410,
                            "reason": "Expired", "message": f"too old resource version: {since} ({self.oldest_rv})"}
                    chunk({"type": "ERROR", "object": gone})
                else:
                    while not self.closed:
                        fresh = [(rv, kind, pod) for rv, kind, pod in self.history if rv > since]
                        for rv, kind, pod in fresh:
                            since = rv
                            if wanted(pod):
                                chunk({"type": kind, "object": pod})
                        if since < self.oldest_rv:  # compacted while we watched: the real server ends here
                            break
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        self.cond.wait(left)
            chunk(None)
        except (BrokenPipeError, ConnectionResetError):
            pass
