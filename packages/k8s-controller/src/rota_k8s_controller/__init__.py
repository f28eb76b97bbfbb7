"""rota on Kubernetes, in the cluster: the tenant-pod controller and the auth key's init container.

``rota k8s controller`` issues each tenant job its token Secret and releases the turn of
jobs whose pods are gone; ``rota k8s install-key`` makes the mounted auth key a file the
servers accept. The rota image installs this without rota-scheduler-k8s, whose manifest
rendering needs kubernetes-validate's schemas.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so
    # that loading the plugin (rota --help) imports none of them
    from rota_k8s_controller.controller import Controller, Eviction, PodTracker, TokenSecrets, dead_reason, grpc_evictor

__all__ = ["Controller", "Eviction", "PodTracker", "TokenSecrets", "dead_reason", "grpc_evictor"]


_HOME = {
    "Controller": "rota_k8s_controller.controller",
    "Eviction": "rota_k8s_controller.controller",
    "PodTracker": "rota_k8s_controller.controller",
    "TokenSecrets": "rota_k8s_controller.controller",
    "dead_reason": "rota_k8s_controller.controller",
    "grpc_evictor": "rota_k8s_controller.controller",
}
__getattr__ = lazy_getattr(__name__, _HOME)
