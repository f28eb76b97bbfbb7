"""rota on Kubernetes, in the cluster: the tenant-pod controller and the auth key's init container.

``rota k8s controller`` issues each tenant job its token Secret and releases the turn of
jobs whose pods are gone; ``rota k8s install-key`` makes the mounted auth key a file the
servers accept. The rota image installs this without rota-scheduler-k8s, whose manifest
rendering needs kubernetes-validate's schemas.
"""

from __future__ import annotations

from rota_k8s_controller.controller import Controller, Eviction, PodTracker, TokenSecrets, dead_reason, grpc_evictor

__all__ = ["Controller", "Eviction", "PodTracker", "TokenSecrets", "dead_reason", "grpc_evictor"]
