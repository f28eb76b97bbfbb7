"""Tenant workloads: one job's Pod or Indexed Job, and its group's shared DRA ResourceClaim.

:func:`tenant` is a pure function of a validated :class:`TenantSpec`, so tests and
``rota k8s tenant`` see the same objects (the cluster side is :mod:`rota_k8s.manifests`).

GPUs and ranks: a group's claim asks for N GPUs of one node (``TenantSpec.gpus``).
With N = 1 a job may run several pods, one rank each (an Indexed Job, ROTA_RANK = the
completion index). With N > 1 the job is one pod holding all N GPUs whose command
starts one process per GPU (``torchrun --nproc-per-node N``); the pod gets no
ROTA_WORLD_SIZE/ROTA_RANK, so ``rota.connect()`` takes each process's rank and the
world size from torchrun's ``RANK``/``WORLD_SIZE`` (or torch.distributed).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rota.config import check_id
from rota.errors import InvalidArgument
from rota_k8s._image import image_problem
from rota_k8s_controller.names import (
    GROUP_LABEL,
    JOB_LABEL,
    PART_OF,
    TOKEN_KEY,
    dns_label,
    dns_label_ok,
    label_value_problem,
    token_secret_name,
)

__all__ = ["CLAIM_API_VERSION", "CLAIM_REQUEST", "DEVICE_CLASS", "GPUS_LABEL", "MAX_GPUS", "TenantSpec", "claim_name",
           "resource_claim", "tenant"]

GPUS_LABEL = "timeslice.io/gpus"  # rota's: GPUs of the group's claim
MAX_GPUS = 64  # GPUs one claim (one node) may ask for
CLAIM_API_VERSION = "resource.k8s.io/v1"
DEVICE_CLASS = "gpu.nvidia.com"
CLAIM_REQUEST = "gpu"
Obj = dict[str, Any]
_RUNTIME_DEFAULT = {"type": "RuntimeDefault"}


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"rota-{component}", "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": "rota-k8s"}


def claim_name(group_id: str) -> str:
    """Name of the ResourceClaim shared by every tenant of ``group_id``."""
    return dns_label(group_id, prefix="rota-group-")


def resource_claim(group_id: str, namespace: str, name: str = "", gpus: int = 1) -> Obj:
    """The group's DRA ResourceClaim: ``gpus`` GPUs of class gpu.nvidia.com on one node, shared by all its tenants."""
    return {
        "apiVersion": CLAIM_API_VERSION, "kind": "ResourceClaim",
        "metadata": {"name": name or claim_name(group_id), "namespace": namespace,
                     "labels": {**_labels("group"), GROUP_LABEL: group_id, GPUS_LABEL: str(gpus)}},
        "spec": {"devices": {"requests": [{"name": CLAIM_REQUEST, "exactly": {
            "deviceClassName": DEVICE_CLASS, "allocationMode": "ExactCount", "count": gpus}}]}},
    }


@dataclass(frozen=True)
class TenantSpec:
    """One tenant workload: which group, which image and command, how many ranks and GPUs.

    ``gpus`` is the GPU count of the group's claim (every tenant of a group must give
    the same); with more than one GPU the job is one pod (``world_size`` 1) whose
    processes take their ranks from torch.distributed. ``token``: the pod reads
    ROTA_TOKEN from the job's Secret, which the controller creates.
    """

    group_id: str
    job_id: str
    image: str
    command: tuple[str, ...]
    namespace: str = "default"
    kind: str = "Job"  # Job (Indexed, one pod per rank) or Pod (one rank)
    world_size: int = 1  # pods of a Job, one rank each
    gpus: int = 1
    orchestrator: str = "rota-orchestrator.rota-system.svc:50051"
    agent: str = "rota-agent.rota-system-agent.svc:9001"
    claim: str = ""  # ResourceClaim name; default: the group's claim_name()
    priority: int = 0
    weight: float = 1.0
    env: dict[str, str] = field(default_factory=dict)
    run_as_user: int = 1000
    token: bool = True

    def check(self) -> None:
        """Raise InvalidArgument naming the first bad field."""
        check_id("group", self.group_id, job_id=self.job_id, group_id=self.group_id)
        check_id("job id", self.job_id, job_id=self.job_id, group_id=self.group_id)
        problem = self._problem()
        if problem:
            raise InvalidArgument(problem, job_id=self.job_id, group_id=self.group_id)

    def _problem(self) -> str | None:
        for kind, value in (("group", self.group_id), ("job id", self.job_id)):
            problem = label_value_problem(kind, value)
            if problem:
                return problem
        if not isinstance(self.namespace, str) or not dns_label_ok(self.namespace):
            return (f"namespace {self.namespace!r} is not a DNS-1123 label (lowercase letters, digits, '-', at "
                    "most 63)")
        if self.kind not in ("Job", "Pod"):
            return f"kind {self.kind!r}: choose Job or Pod"
        if self.kind == "Pod" and self.world_size != 1:
            return f"a Pod runs one rank; world size {self.world_size} needs kind Job"
        if not 1 <= self.world_size <= 1024:
            return f"world size {self.world_size} must be between 1 and 1024"
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or not 1 <= self.gpus <= MAX_GPUS:
            return (f"gpus {self.gpus!r} is out of range: a group's claim asks for 1 to {MAX_GPUS} GPUs of one "
                    f"node; give --gpus N with N from 1 to {MAX_GPUS}")
        if self.gpus > 1 and self.world_size > 1:
            return (f"{self.world_size} ranks (pods) with {self.gpus} GPUs: the group's GPUs are one node's and every "
                    f"pod of the job would see all of them; run one pod (--ranks 1) that starts one process per GPU, "
                    f"e.g. `torchrun --nproc-per-node {self.gpus} ...`")
        if isinstance(self.run_as_user, bool) or not isinstance(self.run_as_user, int) \
                or not 1 <= self.run_as_user <= 2**31 - 1:
            return (f"run as user {self.run_as_user!r}: give a uid from 1 to {2**31 - 1}; tenant pods never run as "
                    "root (Pod Security 'restricted')")
        if not self.command:
            return "no command given: put it after '--'"
        problem = image_problem(self.image)
        if problem:
            return f"image {self.image!r} is not a container image reference: it {problem}"
        for k in self.env:
            if self.gpus > 1 and k in ("ROTA_WORLD_SIZE", "ROTA_RANK"):
                return (f"env {k!r} would be the same for every process of the pod; with {self.gpus} GPUs the ranks "
                        "come from torch.distributed")
            if not k or (k.startswith("ROTA_") and k in _ROTA_ENV):
                return f"env {k!r} is set by rota itself"
        return None


_ROTA_ENV = ("ROTA_GROUP", "ROTA_TENANT", "ROTA_ORCHESTRATOR", "ROTA_WORLD_SIZE", "ROTA_RANK", "ROTA_AGENT",
             "ROTA_TOKEN", "ROTA_K8S_NAMESPACE", "ROTA_K8S_GROUP", "ROTA_K8S_JOB")


def _field(path: str) -> Obj:
    return {"fieldRef": {"fieldPath": path}}


def _tenant_env(t: TenantSpec) -> list[Obj]:
    env: list[Obj] = [
        # rota's ids come from the pod's own namespace and labels, so a relabelled pod, the
        # controller (which issues the token for them) and rota agree: see rota_ids().
        {"name": "ROTA_K8S_NAMESPACE", "valueFrom": _field("metadata.namespace")},
        {"name": "ROTA_K8S_GROUP", "valueFrom": _field(f"metadata.labels['{GROUP_LABEL}']")},
        {"name": "ROTA_K8S_JOB", "valueFrom": _field(f"metadata.labels['{JOB_LABEL}']")},
        {"name": "ROTA_GROUP", "value": "$(ROTA_K8S_NAMESPACE).$(ROTA_K8S_GROUP)"},
        {"name": "ROTA_TENANT", "value": "$(ROTA_K8S_NAMESPACE).$(ROTA_K8S_JOB)"},
        {"name": "ROTA_ORCHESTRATOR", "value": t.orchestrator},
    ]
    if t.token:
        # The controller writes this Secret when it sees the job's first pod; the kubelet
        # starts the container once it exists.
        env.append({"name": "ROTA_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": token_secret_name(t.job_id), "key": TOKEN_KEY}}})
    # One pod, several GPUs: its processes (torchrun's) are the ranks, and only
    # torch.distributed knows them; a pod-wide ROTA_RANK would give all of them rank 0.
    if t.gpus == 1:
        env.append({"name": "ROTA_WORLD_SIZE", "value": str(t.world_size)})
        if t.kind == "Job":
            env.append({"name": "ROTA_RANK",
                        "valueFrom": _field("metadata.annotations['batch.kubernetes.io/job-completion-index']")})
        else:
            env.append({"name": "ROTA_RANK", "value": "0"})
    env += [
        {"name": "ROTA_POD_NAME", "valueFrom": _field("metadata.name")},
        {"name": "ROTA_HOST_IP", "valueFrom": _field("status.hostIP")},
        {"name": "ROTA_AGENT", "value": t.agent},
    ]
    if t.priority:
        env.append({"name": "ROTA_PRIORITY", "value": str(t.priority)})
    if t.weight != 1.0:
        env.append({"name": "ROTA_WEIGHT", "value": str(t.weight)})
    env += [{"name": k, "value": v} for k, v in sorted(t.env.items())]
    return env


def tenant(t: TenantSpec, *, with_claim: bool = True) -> list[Obj]:
    """The tenant workload (and, unless ``with_claim`` is False, the claim it references).

    Applying the claim again for the next tenant of the group is a no-op: its spec is
    identical. Every pod references the claim by name, so all tenants of the group
    land on the node where the claim's GPUs are allocated and see the same devices.
    A tenant with another ``gpus`` renders another spec for the same claim, which the
    API server refuses (the spec is immutable); ``rota k8s tenant --check-claim``
    refuses it before anything is printed. The pod passes Pod Security's ``restricted``
    profile: not root, no privilege escalation, no capabilities, RuntimeDefault seccomp.
    """
    t.check()
    claim = t.claim or claim_name(t.group_id)
    labels = {JOB_LABEL: t.job_id, GROUP_LABEL: t.group_id, GPUS_LABEL: str(t.gpus),
              "app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/component": "tenant"}
    pod_spec: Obj = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,  # a tenant has no business with the API server
        "securityContext": {"runAsNonRoot": True, "runAsUser": t.run_as_user, "runAsGroup": t.run_as_user,
                            "fsGroup": t.run_as_user, "seccompProfile": _RUNTIME_DEFAULT},
        "resourceClaims": [{"name": CLAIM_REQUEST, "resourceClaimName": claim}],
        "containers": [{
            "name": "tenant", "image": t.image, "command": list(t.command), "env": _tenant_env(t),
            "resources": {"claims": [{"name": CLAIM_REQUEST}]},
            "securityContext": {"runAsNonRoot": True, "allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}, "seccompProfile": _RUNTIME_DEFAULT},
        }],
    }
    name = dns_label(t.job_id)
    objs: list[Obj] = []
    if with_claim:
        objs.append(resource_claim(t.group_id, t.namespace, claim, t.gpus))
    if t.kind == "Pod":
        objs.append({"apiVersion": "v1", "kind": "Pod",
                     "metadata": {"name": name, "namespace": t.namespace, "labels": labels}, "spec": pod_spec})
    else:
        objs.append({
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": t.namespace, "labels": labels},
            "spec": {"completions": t.world_size, "parallelism": t.world_size, "completionMode": "Indexed",
                     # All ranks acquire and release together: one lost rank fails the job.
                     "backoffLimit": 0,
                     "template": {"metadata": {"labels": labels}, "spec": pod_spec}},
        })
    return objs
