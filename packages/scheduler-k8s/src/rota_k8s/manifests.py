"""The Kubernetes objects rota needs, as plain dicts ready for ``kubectl apply``.

:func:`render` builds the cluster side (namespace, RBAC, etcd, orchestrator with
its pod-watching controller, agent DaemonSet, PodDisruptionBudgets); :func:`tenant`
builds one tenant workload and its group's shared DRA ResourceClaim. Both are pure
functions of validated input, so tests and ``rota k8s render`` see the same objects,
and :mod:`rota_k8s._validate` checks them against the official OpenAPI schemas.

Conventions shared with llm-d's time-slicing project (shared/WIRE.md): tenant pods
carry ``timeslice.io/job-id`` and ``timeslice.io/group``; the tenants of a group share
one ``resource.k8s.io/v1`` ResourceClaim of device class ``gpu.nvidia.com``. rota adds
``timeslice.io/gpus`` (the claim's GPU count) to the claim and the tenant pods, so a
tenant that disagrees with its group about the count is visible.

GPUs and ranks: a group's claim asks for N GPUs of one node (``TenantSpec.gpus``).
With N = 1 a job may run several pods, one rank each (an Indexed Job, ROTA_RANK = the
completion index). With N > 1 the job is one pod holding all N GPUs whose command
starts one process per GPU (``torchrun --nproc-per-node N``); the pod gets no
ROTA_WORLD_SIZE/ROTA_RANK, so ``rota.connect()`` takes each process's rank and the
world size from torchrun's ``RANK``/``WORLD_SIZE`` (or torch.distributed).

Security model: the orchestrator and controller run as non-root with no capabilities
and a read-only root filesystem; the controller may only get/list/watch pods. The
agent needs exactly two things for whole-process parking (the CUDA driver's
checkpoint API on tenant processes of other pods): the host PID namespace to see
those processes, and CAP_SYS_PTRACE to act on them. It is not privileged, cannot
escalate, mounts no host paths and no API token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import yaml

from rota._ids import check_id
from rota.errors import InvalidArgument
from rota_k8s._values import Values, dns_label, label_value_problem

__all__ = [
    "CLAIM_API_VERSION",
    "DEVICE_CLASS",
    "GPUS_LABEL",
    "GROUP_LABEL",
    "JOB_LABEL",
    "MAX_GPUS",
    "TenantSpec",
    "claim_name",
    "render",
    "resource_claim",
    "tenant",
    "to_yaml",
]

JOB_LABEL = "timeslice.io/job-id"
GROUP_LABEL = "timeslice.io/group"
GPUS_LABEL = "timeslice.io/gpus"  # rota's: GPUs of the group's claim
MAX_GPUS = 64  # GPUs one claim (one node) may ask for
CLAIM_API_VERSION = "resource.k8s.io/v1"
DEVICE_CLASS = "gpu.nvidia.com"
CLAIM_REQUEST = "gpu"
PART_OF = "rota"
# grpc.health.v1 service that is SERVING only on the orchestrator replica that leads (rota_etcd)
ORCHESTRATOR_SERVICE = "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
Obj = dict[str, Any]


def _labels(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"rota-{component}", "app.kubernetes.io/component": component,
            "app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": "rota-k8s"}


def _selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"rota-{component}", "app.kubernetes.io/part-of": PART_OF}


def _meta(name: str, component: str, namespace: str | None = None) -> Obj:
    meta: Obj = {"name": name, "labels": _labels(component)}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _grpc_probes(port: int, *, initial: int = 5, ready_service: str = "") -> Obj:
    ready = {"port": port, "service": ready_service} if ready_service else {"port": port}
    return {
        "readinessProbe": {"grpc": ready, "initialDelaySeconds": initial, "periodSeconds": 5,
                           "failureThreshold": 3},
        "livenessProbe": {"grpc": {"port": port}, "initialDelaySeconds": initial + 10, "periodSeconds": 10,
                          "failureThreshold": 6},
    }


_RESTRICTED = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "allowPrivilegeEscalation": False,
               "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
               "seccompProfile": {"type": "RuntimeDefault"}}


def _pdb(name: str, component: str, ns: str, **budget: Any) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(name, component, ns),
            "spec": {**budget, "selector": {"matchLabels": _selector(component)}}}


# ------------------------------------------------------------------ cluster side


def render(values: Values) -> list[Obj]:
    """Every object of a rota installation, in apply order (namespace first)."""
    ns = values.namespace
    objs: list[Obj] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": _meta(ns, "namespace")}]
    objs += _rbac(values)
    if not values.external_etcd:
        objs += _etcd(values)
    objs += _orchestrator(values)
    objs += _agent(values)
    return objs


def _rbac(v: Values) -> list[Obj]:
    ns = v.namespace
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta("rota-orchestrator", "orchestrator", ns),
         "automountServiceAccountToken": True},
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta("rota-agent", "agent", ns),
         "automountServiceAccountToken": False},
        # Tenants run in any namespace, so the controller watches pods cluster-wide; read-only.
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": _meta(f"rota-controller-{ns}", "controller"),
         "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": _meta(f"rota-controller-{ns}", "controller"),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                     "name": f"rota-controller-{ns}"},
         "subjects": [{"kind": "ServiceAccount", "name": "rota-orchestrator", "namespace": ns}]},
    ]


def _etcd(v: Values) -> list[Obj]:
    ns, e = v.namespace, v.etcd
    peers = ",".join(f"rota-etcd-{i}=http://rota-etcd-{i}.rota-etcd.{ns}.svc:2380" for i in range(e.replicas))
    # No shell: Kubernetes expands $(POD_NAME) from the container's env.
    command = [
        "etcd", "--name=$(POD_NAME)", "--data-dir=/var/lib/etcd/data",
        "--listen-client-urls=http://0.0.0.0:2379", "--listen-peer-urls=http://0.0.0.0:2380",
        f"--advertise-client-urls=http://$(POD_NAME).rota-etcd.{ns}.svc:2379",
        f"--initial-advertise-peer-urls=http://$(POD_NAME).rota-etcd.{ns}.svc:2380",
        f"--initial-cluster={peers}", "--initial-cluster-state=new", f"--initial-cluster-token=rota-etcd-{ns}",
    ]
    pvc: Obj = {"metadata": {"name": "data"},
                "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": e.storage}}}}
    if e.storageClassName:
        pvc["spec"]["storageClassName"] = e.storageClassName
    return [
        # Headless: stable per-member DNS names for peers and for the orchestrator's client URLs.
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta("rota-etcd", "etcd", ns),
         "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": _selector("etcd"),
                  "ports": [{"name": "client", "port": 2379, "targetPort": 2379},
                            {"name": "peer", "port": 2380, "targetPort": 2380}]}},
        {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta("rota-etcd", "etcd", ns),
         "spec": {
             "serviceName": "rota-etcd", "replicas": e.replicas, "podManagementPolicy": "Parallel",
             "selector": {"matchLabels": _selector("etcd")},
             "template": {
                 "metadata": {"labels": _labels("etcd")},
                 "spec": {
                     "automountServiceAccountToken": False,
                     "securityContext": {"fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
                     "affinity": _spread("etcd"),
                     "containers": [{
                         "name": "etcd", "image": e.image, "imagePullPolicy": v.imagePullPolicy,
                         "command": command,
                         "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                         "ports": [{"name": "client", "containerPort": 2379},
                                   {"name": "peer", "containerPort": 2380}],
                         # etcd serves grpc.health.v1 on its client port.
                         **_grpc_probes(2379, initial=10),
                         "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}},
                         "securityContext": dict(_RESTRICTED),
                         "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                     }],
                 },
             },
             "volumeClaimTemplates": [pvc],
         }},
        # Keep quorum through voluntary disruptions (drains): at most one member down.
        _pdb("rota-etcd", "etcd", ns, maxUnavailable=1),
    ]


def _spread(component: str) -> Obj:
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": _selector(component)}}}]}}


def _orchestrator(v: Values) -> list[Obj]:
    ns, o = v.namespace, v.orchestrator
    serve = ["rota", "--log-level", v.logLevel, "orchestrator", "serve", "--listen", "0.0.0.0:50051",
             "--etcd", ",".join(v.etcd_urls()), "--policy", o.policy, "--ttl", _num(o.ttl),
             "--park-timeout", _num(o.parkTimeout), "--max-turn", _num(o.maxTurn)]
    controller = ["rota", "--log-level", v.logLevel, "k8s", "controller",
                  "--orchestrator", v.orchestrator_address()]
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta("rota-orchestrator", "orchestrator", ns),
         "spec": {"selector": _selector("orchestrator"),
                  "ports": [{"name": "grpc", "port": 50051, "targetPort": 50051, "appProtocol": "grpc"}]}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta("rota-orchestrator", "orchestrator", ns),
         "spec": {
             "replicas": o.replicas,
             "selector": {"matchLabels": _selector("orchestrator")},
             "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1}},
             "template": {
                 "metadata": {"labels": _labels("orchestrator")},
                 "spec": {
                     "serviceAccountName": "rota-orchestrator",
                     "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                     "affinity": _spread("orchestrator"),
                     "containers": [
                         {
                             # Replicas elect a leader through etcd; only the leader grants, and the
                             # fencing token proves it. Readiness (grpc health of the orchestrator
                             # service) is SERVING on the leader only, so the Service sends clients
                             # there; liveness checks the process ("" is SERVING on every replica).
                             "name": "orchestrator", "image": v.image, "imagePullPolicy": v.imagePullPolicy,
                             "command": serve,
                             "ports": [{"name": "grpc", "containerPort": 50051}],
                             **_grpc_probes(50051, ready_service=ORCHESTRATOR_SERVICE),
                             "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                             "securityContext": dict(_RESTRICTED),
                         },
                         {
                             # Releases the turns of tenant pods that are deleted, evicted or whose
                             # node is lost. Evict is idempotent, so every replica may run one.
                             "name": "controller", "image": v.image, "imagePullPolicy": v.imagePullPolicy,
                             "command": controller,
                             "resources": {"requests": {"cpu": "20m", "memory": "64Mi"}},
                             "securityContext": dict(_RESTRICTED),
                         },
                     ],
                 },
             },
         }},
        _pdb("rota-orchestrator", "orchestrator", ns, minAvailable=1),
    ]


def _agent(v: Values) -> list[Obj]:
    ns, a = v.namespace, v.agent
    spec: Obj = {
        "serviceAccountName": "rota-agent",
        "automountServiceAccountToken": False,
        # Whole-process parking acts on tenant processes in other pods of the node.
        "hostPID": True,
        "nodeSelector": dict(a.nodeSelector),
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "containers": [{
            "name": "agent", "image": v.image, "imagePullPolicy": v.imagePullPolicy,
            "command": ["rota", "--log-level", v.logLevel, "agent", "serve", "--listen", f"0.0.0.0:{a.port}"],
            "env": [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
                    {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                    {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}],
            # hostPort: tenants reach their node's agent at $(HOST_IP):port.
            "ports": [{"name": "grpc", "containerPort": a.port, "hostPort": a.port}],
            **_grpc_probes(a.port),
            "resources": {"requests": {"cpu": "50m", "memory": "128Mi"}},
            "securityContext": {
                "runAsUser": 0, "runAsNonRoot": False, "privileged": False, "allowPrivilegeEscalation": False,
                "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]},
                "seccompProfile": {"type": "RuntimeDefault"},
            },
        }],
    }
    if a.runtimeClassName:
        spec["runtimeClassName"] = a.runtimeClassName
    return [
        {"apiVersion": "v1", "kind": "Service", "metadata": _meta("rota-agent", "agent", ns),
         "spec": {"selector": _selector("agent"), "internalTrafficPolicy": "Local",
                  "ports": [{"name": "grpc", "port": a.port, "targetPort": a.port, "appProtocol": "grpc"}]}},
        {"apiVersion": "apps/v1", "kind": "DaemonSet", "metadata": _meta("rota-agent", "agent", ns),
         "spec": {"selector": {"matchLabels": _selector("agent")},
                  "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
                  "template": {"metadata": {"labels": _labels("agent")}, "spec": spec}}},
    ]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


# ------------------------------------------------------------------ tenant side


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
    processes take their ranks from torch.distributed.
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
    agent_port: int = 9001
    claim: str = ""  # ResourceClaim name; default: the group's claim_name()
    priority: int = 0
    weight: float = 1.0
    env: dict[str, str] = field(default_factory=dict)

    def check(self) -> None:
        """Raise InvalidArgument naming the first bad field."""
        check_id("group", self.group_id, job_id=self.job_id, group_id=self.group_id)
        check_id("job id", self.job_id, job_id=self.job_id, group_id=self.group_id)
        for kind, value in (("group", self.group_id), ("job id", self.job_id)):
            problem = label_value_problem(kind, value)
            if problem:
                raise InvalidArgument(problem, job_id=self.job_id, group_id=self.group_id)
        if self.kind not in ("Job", "Pod"):
            raise InvalidArgument(f"kind {self.kind!r}: choose Job or Pod", job_id=self.job_id,
                                  group_id=self.group_id)
        if self.kind == "Pod" and self.world_size != 1:
            raise InvalidArgument(f"a Pod runs one rank; world size {self.world_size} needs kind Job",
                                  job_id=self.job_id, group_id=self.group_id)
        if not 1 <= self.world_size <= 1024:
            raise InvalidArgument(f"world size {self.world_size} must be between 1 and 1024",
                                  job_id=self.job_id, group_id=self.group_id)
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or not 1 <= self.gpus <= MAX_GPUS:
            raise InvalidArgument(f"gpus {self.gpus!r} is out of range: a group's claim asks for 1 to {MAX_GPUS} "
                                  f"GPUs of one node; give --gpus N with N from 1 to {MAX_GPUS}",
                                  job_id=self.job_id, group_id=self.group_id)
        if self.gpus > 1 and self.world_size > 1:
            raise InvalidArgument(
                f"{self.world_size} ranks (pods) with {self.gpus} GPUs: the group's GPUs are one node's and every pod "
                f"of the job would see all of them; run one pod (--ranks 1) that starts one process per GPU, e.g. "
                f"`torchrun --nproc-per-node {self.gpus} ...`", job_id=self.job_id, group_id=self.group_id)
        if not self.command:
            raise InvalidArgument("no command given: put it after '--'", job_id=self.job_id,
                                  group_id=self.group_id)
        if not self.image or " " in self.image:
            raise InvalidArgument(f"image {self.image!r} is not a container image reference",
                                  job_id=self.job_id, group_id=self.group_id)
        for k in self.env:
            if self.gpus > 1 and k in ("ROTA_WORLD_SIZE", "ROTA_RANK"):
                raise InvalidArgument(f"env {k!r} would be the same for every process of the pod; with {self.gpus} "
                                      "GPUs the ranks come from torch.distributed", job_id=self.job_id,
                                      group_id=self.group_id)
            if not k or (k.startswith("ROTA_") and k in _ROTA_ENV):
                raise InvalidArgument(f"env {k!r} is set by rota itself", job_id=self.job_id,
                                      group_id=self.group_id)


_ROTA_ENV = ("ROTA_GROUP", "ROTA_TENANT", "ROTA_ORCHESTRATOR", "ROTA_WORLD_SIZE", "ROTA_RANK", "ROTA_AGENT")


def _tenant_env(t: TenantSpec) -> list[Obj]:
    env: list[Obj] = [
        {"name": "ROTA_GROUP", "value": t.group_id},
        # The tenant id comes from the pod's own label, so a relabelled pod and rota agree.
        {"name": "ROTA_TENANT", "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_LABEL}']"}}},
        {"name": "ROTA_ORCHESTRATOR", "value": t.orchestrator},
    ]
    # One pod, several GPUs: its processes (torchrun's) are the ranks, and only
    # torch.distributed knows them; a pod-wide ROTA_RANK would give all of them rank 0.
    if t.gpus == 1:
        env.append({"name": "ROTA_WORLD_SIZE", "value": str(t.world_size)})
        if t.kind == "Job":
            env.append({"name": "ROTA_RANK", "valueFrom": {"fieldRef": {
                "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}})
        else:
            env.append({"name": "ROTA_RANK", "value": "0"})
    env += [
        {"name": "ROTA_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "ROTA_HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "ROTA_AGENT", "value": f"$(ROTA_HOST_IP):{t.agent_port}"},
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
    refuses it before anything is printed.
    """
    t.check()
    claim = t.claim or claim_name(t.group_id)
    labels = {JOB_LABEL: t.job_id, GROUP_LABEL: t.group_id, GPUS_LABEL: str(t.gpus),
              "app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/component": "tenant"}
    pod_spec: Obj = {
        "restartPolicy": "Never",
        "resourceClaims": [{"name": CLAIM_REQUEST, "resourceClaimName": claim}],
        "containers": [{
            "name": "tenant", "image": t.image, "command": list(t.command), "env": _tenant_env(t),
            "resources": {"claims": [{"name": CLAIM_REQUEST}]},
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


def to_yaml(objs: Sequence[Obj]) -> str:
    """A multi-document YAML stream (``---`` separated), as ``kubectl apply -f -`` reads it."""
    return yaml.dump_all(list(objs), Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared dicts out in full: ``&id001``/``*id001`` anchors confuse readers of manifests."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
