"""Serving gRPC the way every rota server does: bound with TLS or on loopback, with health and clear errors.

Used by the orchestrator, the node agent and any plugin that serves gRPC.
"""

from __future__ import annotations

from rota._orchestrator.grpc_server import bind, free_port, health_servicer, rpc_errors, serve_in_thread, server_tls

__all__ = ["bind", "free_port", "health_servicer", "rpc_errors", "serve_in_thread", "server_tls"]
