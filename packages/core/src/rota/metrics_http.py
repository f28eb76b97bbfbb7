"""Serving ``/metrics`` without handing out what ``Status`` hides: tenant ids behind a token, or hashed.

Used by the orchestrator (``rota orchestrator serve --metrics-listen``) and the node agent
(``rota agent serve --metrics-listen``). Their metrics carry group and job ids as labels;
``Status`` shows a tenant only its own group, so an open ``/metrics`` would list every
team's ids to anyone who reaches the port. When the server checks tokens (``--auth-key``),
``/metrics`` answers only a request with ``Authorization: Bearer <admin token>``
(Prometheus: ``authorization: {credentials_file: ...}``), else 401. ``hash_ids``
(``--metrics-hash-ids``) serves it without a token, with every ``group`` and ``job`` label
replaced by ``h-`` and 12 hex characters of an HMAC-SHA256 keyed with the auth key (or,
without one, a key drawn at start): stable across scrapes and restarts with the same key,
never reversible by guessing ids. A listener beyond loopback is warned about at start
(:func:`warn_if_exposed`).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
import socketserver
import threading
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.samples import Sample

from rota.auth import Principal, ServerAuth
from rota.errors import RotaError

ID_LABELS = ("group", "job")


class HashedIds:
    """A view of ``registry`` whose ``group``/``job`` label values are keyed hashes (see the module docs)."""

    def __init__(self, registry: Any, key: bytes | None) -> None:
        self.registry, self.key = registry, key or secrets.token_bytes(32)

    def hashed(self, value: str) -> str:
        return "h-" + hmac.new(self.key, value.encode(), hashlib.sha256).hexdigest()[:12] if value else value

    def collect(self) -> Iterator[Any]:
        for family in self.registry.collect():
            family.samples = [Sample(s.name, {k: self.hashed(v) if k in ID_LABELS else v for k, v in s.labels.items()},
                                     s.value, s.timestamp, s.exemplar) for s in family.samples]
            yield family


class _Threading(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def serve_metrics(registry: Any, host: str, port: int, *, auth: ServerAuth | None = None,
                  hash_ids: bool = False) -> WSGIServer:
    """``/metrics`` of ``registry`` on ``host:port`` in a thread of its own: with ``auth`` (a key) only for an
    admin token; with ``hash_ids`` to anyone, ids hashed. Returns the server (``shutdown()`` stops it)."""
    view = HashedIds(registry, auth.key if auth else None) if hash_ids else registry
    need_token = auth is not None and auth.key is not None and not hash_ids

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        if need_token:
            who = _caller(auth, environ.get("HTTP_AUTHORIZATION", ""))  # type: ignore[arg-type]
            if who is None or not who.admin:
                start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                    ("WWW-Authenticate", 'Bearer realm="rota"')])
                return [b"/metrics lists every tenant's ids: send Authorization: Bearer <admin token> "
                        b"(rota token issue --admin), or serve it with --metrics-hash-ids\n"]
        if environ.get("PATH_INFO", "/") not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"only /metrics is served here\n"]
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST)])
        return [generate_latest(view)]

    server = make_server(host, port, app, server_class=_Threading, handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, name="rota-metrics", daemon=True).start()
    return server


def _caller(auth: ServerAuth, header: str) -> Principal | None:
    try:
        return auth.principal([("authorization", header)] if header else [])
    except RotaError:
        return None


def warn_if_exposed(host: str) -> str:
    """A warning for a metrics listener beyond loopback ("" on loopback)."""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = False
    return "" if loopback else (f"WARNING: /metrics on {host} is reachable beyond this host: bind it where only "
                                "your Prometheus reaches (tenant ids need an admin token, or --metrics-hash-ids)")


__all__ = ["HashedIds", "serve_metrics", "warn_if_exposed"]
