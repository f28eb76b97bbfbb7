"""A tenant's link to its orchestrator: the gRPC channel and stub, re-pointed when another replica leads.

One :class:`OrchestratorLink` per :class:`~rota._tenant.client.Gpu`, shared by what talks to the
orchestrator for it: the Attach session (:mod:`rota._tenant.session`) and the lease hooks, which are
handed the link as an argument (``rota_acquire(request, link)``), so that no hook calls back into the
client that called it.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations here: rota.types re-exports OrchestratorLink, and plugins that import
    import grpc  # those types load without grpc (rota --help)

log = logging.getLogger(__name__)


class OrchestratorLink:
    """The channel to the orchestrator at ``endpoint`` (one address, or replicas comma-separated), every
    call carrying ``token``; :attr:`stub` is a ``rota.v1.RotaService`` stub on it."""

    def __init__(self, endpoint: str, token: str = "", *, name: str = "") -> None:
        self.endpoint, self.name = endpoint, name
        self._token = token
        self._lock = threading.Lock()
        self._target = endpoint
        self._old_channels: list[grpc.Channel] = []
        self._channel = _channel(endpoint, token)
        self.stub: Any = _stub(self._channel)

    @property
    def target(self) -> str:
        """The addresses the channel dials now, the leader first once one was named."""
        return self._target

    def follow(self, leader: str) -> None:
        """Talk to the replica at ``leader`` first (an orchestrator said it leads).

        The other replicas stay in the channel behind it, so if the leader dies the
        channel fails over to one of them, which names the next leader in turn.
        """
        endpoints = [e.strip() for e in self.endpoint.split(",") if e.strip()]
        target = ",".join([leader, *[e for e in endpoints if e != leader]])
        with self._lock:
            if not leader or target == self._target:
                return
            log.info("job %s: orchestrator leader is %s; following it", self.name, leader)
            # The old channel stays open until close(): another thread may be mid-call on it
            # (that call gets "not the leader" too and retries on the new stub).
            self._old_channels.append(self._channel)
            self._channel, self._target = _channel(target, self._token), target
            self.stub = _stub(self._channel)

    def close(self) -> None:
        for ch in (*self._old_channels, self._channel):
            ch.close()


def _stub(channel: grpc.Channel) -> Any:
    from rota._generated import rota_v1_pb2_grpc

    return rota_v1_pb2_grpc.RotaServiceStub(channel)


def _channel(endpoint: str, token: str = "") -> grpc.Channel:
    """A channel to one endpoint, or to several replicas (comma-separated) with failover; every call
    carries ``token`` (TLS from ``ROTA_TLS_*``, see :func:`rota.auth.channel`)."""
    from rota import auth

    endpoints = [e.strip() for e in endpoint.split(",") if e.strip()]
    # Reconnect within a second once an orchestrator is back (gRPC's default backoff grows
    # to two minutes): a tenant must re-attach within its TTL after a restart or failover.
    options = [("grpc.enable_retries", 1), ("grpc.keepalive_time_ms", 10_000),
               ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
               ("grpc.max_reconnect_backoff_ms", 1000)]
    if len(endpoints) > 1 and not any(e.startswith("unix:") for e in endpoints):
        return auth.channel("ipv4:" + ",".join(endpoints), token=token, options=options)
    return auth.channel(endpoints[0], token=token, options=options)


__all__ = ["OrchestratorLink"]
