"""rota on Kubernetes: deploy the orchestrator and agents, place tenants on shared GPUs.

Install ``rota-scheduler-k8s`` and ``rota k8s`` (or ``kubectl rota``) appears::

    rota k8s render --image registry.example/rota:0.1.0 | kubectl apply -f -
    rota k8s tenant --group grp0 --image registry.example/ppo:1 -- python train.py | kubectl apply -f -
    kubectl rota status --orchestrator 127.0.0.1:50051

Tenants of one group reference one DRA ``ResourceClaim`` (``resource.k8s.io/v1``,
device class ``gpu.nvidia.com``, ``--gpus N`` devices of one node) and take turns on
its GPUs through the orchestrator;
the controller beside the orchestrator releases the turn of pods that die.

The library side: :func:`render` and :func:`tenant` build the objects as dicts,
:func:`load_values` validates deployment values, :func:`validate_objects` checks
objects against the official schemas. :class:`Controller`, the pod watcher, lives in
rota-k8s-controller (what the image installs) and is re-exported here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota.compat import lazy_getattr

if TYPE_CHECKING:  # the public names, for type checkers; at run time each loads on first use, so
    # that loading the plugin (rota --help) imports none of them
    from rota_k8s._values import Values, ValuesError, load_values
    from rota_k8s.manifests import render, to_yaml
    from rota_k8s.workloads import (
        CLAIM_API_VERSION,
        DEVICE_CLASS,
        GPUS_LABEL,
        MAX_GPUS,
        TenantSpec,
        claim_name,
        resource_claim,
        tenant,
    )
    from rota_k8s_controller.controller import Controller, Eviction, PodTracker, dead_reason
    from rota_k8s_controller.names import GROUP_LABEL, JOB_LABEL

__all__ = [
    "CLAIM_API_VERSION",
    "DEVICE_CLASS",
    "GPUS_LABEL",
    "GROUP_LABEL",
    "JOB_LABEL",
    "MAX_GPUS",
    "Controller",
    "Eviction",
    "ManifestError",
    "PodTracker",
    "TenantSpec",
    "Values",
    "ValuesError",
    "claim_name",
    "dead_reason",
    "load_values",
    "render",
    "resource_claim",
    "tenant",
    "to_yaml",
    "validate_objects",
]


_HOME = {
    "ManifestError": "rota_k8s._validate",
    "validate_objects": "rota_k8s._validate",
    "Values": "rota_k8s._values",
    "ValuesError": "rota_k8s._values",
    "load_values": "rota_k8s._values",
    "CLAIM_API_VERSION": "rota_k8s.workloads",
    "DEVICE_CLASS": "rota_k8s.workloads",
    "GPUS_LABEL": "rota_k8s.workloads",
    "GROUP_LABEL": "rota_k8s_controller.names",
    "JOB_LABEL": "rota_k8s_controller.names",
    "MAX_GPUS": "rota_k8s.workloads",
    "TenantSpec": "rota_k8s.workloads",
    "claim_name": "rota_k8s.workloads",
    "render": "rota_k8s.manifests",
    "resource_claim": "rota_k8s.workloads",
    "tenant": "rota_k8s.workloads",
    "to_yaml": "rota_k8s.manifests",
    "Controller": "rota_k8s_controller.controller",
    "Eviction": "rota_k8s_controller.controller",
    "PodTracker": "rota_k8s_controller.controller",
    "dead_reason": "rota_k8s_controller.controller",
}
__getattr__ = lazy_getattr(__name__, _HOME)
