"""The Kubernetes objects rota needs, as plain dicts ready for ``kubectl apply``.

:func:`render` builds the cluster side (namespaces, RBAC, NetworkPolicies, etcd, the
orchestrator with its pod-watching controller, the agent DaemonSet, PodDisruptionBudgets);
:func:`rota_k8s.workloads.tenant` (re-exported here) builds one tenant workload and its
group's shared DRA ResourceClaim. Both are pure
functions of validated input, so tests and ``rota k8s render`` see the same objects,
and :mod:`rota_k8s._validate` checks them against the official OpenAPI schemas.

Conventions shared with llm-d's time-slicing project (its v1alpha1 API): tenant pods
carry ``timeslice.io/job-id`` and ``timeslice.io/group``; the tenants of a group share
one ``resource.k8s.io/v1`` ResourceClaim of device class ``gpu.nvidia.com``. rota adds
``timeslice.io/gpus`` (the claim's GPU count) to the claim and the tenant pods, so a
tenant that disagrees with its group about the count is visible.

Security model (issue 17): every tenant may be another team. A job's identity is its
namespace and its label (:func:`rota_ids`); the controller issues each job a token for
exactly that identity into a Secret of the job's namespace (:func:`token_secret_name`),
read by the pod as ROTA_TOKEN. The orchestrator and the agent check tokens against the
auth key, a Secret the operator creates (never rendered); etcd takes only clients and
peers with a certificate of its CA. NetworkPolicies admit only the paths rota uses.
rota's namespace enforces Pod Security ``restricted``: orchestrator, controller and etcd
run as non-root with no capabilities, a read-only root filesystem and RuntimeDefault
seccomp; the controller may read pods and write (never read) Secrets in the tenant
namespaces only. The agent lives in a namespace of its own, ``privileged``, because
whole-process parking (the CUDA driver's checkpoint API on tenant processes of other
pods) needs the host PID namespace and CAP_SYS_PTRACE; it is not privileged otherwise,
cannot escalate, mounts no host paths and no API token, and binds its pod's address
only. Tenant pods pass ``restricted``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import yaml

from rota_k8s._values import Values
from rota_k8s.workloads import (
    _RUNTIME_DEFAULT,
    CLAIM_API_VERSION,
    DEVICE_CLASS,
    GPUS_LABEL,
    MAX_GPUS,
    Obj,
    TenantSpec,
    _labels,
    claim_name,
    resource_claim,
    tenant,
)
from rota_k8s_controller.names import GROUP_LABEL, JOB_LABEL, PART_OF, TOKEN_KEY, rota_ids, token_secret_name

__all__ = [
    "CLAIM_API_VERSION",
    "DEVICE_CLASS",
    "GPUS_LABEL",
    "GROUP_LABEL",
    "JOB_LABEL",
    "MAX_GPUS",
    "TOKEN_KEY",
    "TenantSpec",
    "claim_name",
    "render",
    "resource_claim",
    "rota_ids",
    "tenant",
    "to_yaml",
    "token_secret_name",
]

# grpc.health.v1 names (rota._orchestrator.service): the orchestrator service is SERVING on every replica that
# answers (the leader, and followers that know it and redirect: readiness); rota.leader on the leader only.
ORCHESTRATOR_SERVICE = "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
LEADER_HEALTH = "rota.leader"
ADMIN_ACCESS_LABEL = "resource.kubernetes.io/admin-access"  # lets a namespace's claims ask for admin access


def _selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": f"rota-{component}", "app.kubernetes.io/part-of": PART_OF}


def _meta(name: str, component: str, namespace: str | None = None) -> Obj:
    meta: Obj = {"name": name, "labels": _labels(component)}
    if namespace:
        meta["namespace"] = namespace
    return meta


def _probes(ready: Obj, live: Obj, initial: int) -> Obj:
    return {"readinessProbe": {**ready, "initialDelaySeconds": initial, "periodSeconds": 5, "failureThreshold": 3},
            "livenessProbe": {**live, "initialDelaySeconds": initial + 10, "periodSeconds": 10,
                              "failureThreshold": 6}}


def _grpc_probes(port: int, *, initial: int = 5, ready_service: str = "") -> Obj:
    ready = {"port": port, "service": ready_service} if ready_service else {"port": port}
    return _probes({"grpc": ready}, {"grpc": {"port": port}}, initial)


_RESTRICTED = {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532, "allowPrivilegeEscalation": False,
               "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]},
               "seccompProfile": {"type": "RuntimeDefault"}}


def _http_probes(port: int, *, ready: str, live: str, initial: int = 5) -> Obj:
    return _probes({"httpGet": {"port": port, "path": ready}}, {"httpGet": {"port": port, "path": live}}, initial)


def _resources(cpu: str, memory: str, memory_limit: str) -> Obj:
    """Requests, and a memory limit. No CPU limit: throttling would delay heartbeats and grants, and a
    turn's timing is what rota is for; the requests reserve what each needs."""
    return {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory_limit}}


def _pdb(name: str, component: str, ns: str, **budget: Any) -> Obj:
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget", "metadata": _meta(name, component, ns),
            "spec": {**budget, "selector": {"matchLabels": _selector(component)}}}


# ------------------------------------------------------------------ cluster side

AUTH_DIR = "/etc/rota/auth"  # the owner-only copy of the auth key (memory emptyDir): --auth-key AUTH_DIR/key
AUTH_SECRET_DIR = "/etc/rota/auth-secret"  # the Secret as Kubernetes mounts it: read by the init container only
ETCD_CLIENT_DIR = "/etc/rota/etcd-tls"  # the orchestrator's etcd client certificate (ROTA_ETCD_CA/CERT/KEY)
ETCD_TLS_DIR = "/etc/etcd/tls"  # the members' certificate, for clients and peers
SA_TOKEN_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"  # where the in-cluster client looks
CONTROLLER_HEALTH_PORT = 8081  # rota k8s controller --health-listen: /healthz for the kubelet only
ETCD_METRICS_PORT = 2381  # plain HTTP /health for the kubelet's probes only (no NetworkPolicy peer may reach it)
TENANT_SELECTOR = {"matchExpressions": [{"key": GROUP_LABEL, "operator": "Exists"}]}
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"  # set on every namespace by the API server


def render(values: Values) -> list[Obj]:
    """Every object of a rota installation, in apply order (namespaces first)."""
    objs: list[Obj] = [_namespace(values.namespace, "restricted"),
                       _namespace(values.agent_namespace, "privileged",
                                  admin_access=values.agent.gpuAccess == "dra")]
    pc = values.priorityClass
    if pc.name and pc.create:
        objs.append({"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
                     "metadata": _meta(pc.name, "priority"), "value": pc.value,
                     "preemptionPolicy": "PreemptLowerPriority", "globalDefault": False,
                     "description": "rota: etcd, orchestrator and node agents, scheduled before their tenants"})
    objs += _rbac(values)
    objs += _network_policies(values)
    if not values.external_etcd:
        objs += _etcd(values)
    objs += _orchestrator(values)
    objs += _agent(values)
    return objs


def _namespace(name: str, pod_security: str, *, admin_access: bool = False) -> Obj:
    """A namespace whose Pod Security Admission level is enforced (and audited and warned about);
    ``admin_access``: its ResourceClaims may ask for DRA admin access (the agent's, to every GPU of its node)."""
    meta = _meta(name, "namespace")
    meta["labels"].update({f"pod-security.kubernetes.io/{mode}": pod_security for mode in ("enforce", "audit", "warn")})
    if admin_access:
        meta["labels"][ADMIN_ACCESS_LABEL] = "true"
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


def _rbac(v: Values) -> list[Obj]:
    """Service accounts, and the controller's rights: in tenant namespaces only, pods read, token Secrets written.

    There is no ClusterRole: the controller watches each tenant namespace on its own, and
    may create, replace and delete Secrets there (one per job, holding its token) but never
    read one.
    """
    ns = v.namespace
    name = f"rota-controller-{ns}"
    objs: list[Obj] = [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta("rota-orchestrator", "orchestrator", ns),
         "automountServiceAccountToken": False},  # projected into the controller container only
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta("rota-agent", "agent", v.agent_namespace),
         "automountServiceAccountToken": False},
    ]
    for tenant_ns in v.tenantNamespaces:
        objs += [
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(name, "controller",
                                                                                             tenant_ns),
             "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                       {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "update", "delete"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
             "metadata": _meta(name, "controller", tenant_ns),
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
             "subjects": [{"kind": "ServiceAccount", "name": "rota-orchestrator", "namespace": ns}]},
        ]
    return objs


def _tenant_peer(v: Values) -> Obj:
    """Tenant pods (labelled with a group) of the tenant namespaces."""
    return {"namespaceSelector": {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In",
                                                        "values": list(v.tenantNamespaces)}]},
            "podSelector": TENANT_SELECTOR}


def _policy(name: str, ns: str, component: str, selector: Obj, ingress: list[Obj]) -> Obj:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": _meta(name, component, ns),
            "spec": {"podSelector": selector, "policyTypes": ["Ingress"], "ingress": ingress}}


def _network_policies(v: Values) -> list[Obj]:
    """Who may connect to what: each rota namespace denies all ingress but the paths rota uses.

    etcd: its client port from the orchestrator, its peer port from its members. The
    orchestrator: from tenant pods of the tenant namespaces and from itself (the controller
    beside it goes through the Service). The agent: from the orchestrator and from tenant pods
    (they open their WorkloadChannel to it). The kubelet's probes come from the node, which
    no NetworkPolicy can refuse.
    """
    ns, agent_ns = v.namespace, v.agent_namespace
    orchestrator = {"podSelector": {"matchLabels": _selector("orchestrator")}}
    objs = [_policy("rota-default-deny", ns, "network", {}, []),
            _policy("rota-default-deny", agent_ns, "network", {}, [])]
    if not v.external_etcd:
        objs.append(_policy("rota-etcd", ns, "etcd", {"matchLabels": _selector("etcd")}, [
            {"from": [orchestrator], "ports": [{"protocol": "TCP", "port": 2379}]},
            {"from": [{"podSelector": {"matchLabels": _selector("etcd")}}], "ports": [{"protocol": "TCP",
                                                                                       "port": 2380}]}]))
    scrape = _scrapers(v)
    objs.append(_policy("rota-orchestrator", ns, "orchestrator", {"matchLabels": _selector("orchestrator")}, [
        {"from": [orchestrator, _tenant_peer(v)], "ports": [{"protocol": "TCP", "port": 50051}]}, *scrape]))
    rota_orchestrator = {**orchestrator, "namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}}
    objs.append(_policy("rota-agent", agent_ns, "agent", {"matchLabels": _selector("agent")}, [
        {"from": [rota_orchestrator, _tenant_peer(v)], "ports": [{"protocol": "TCP", "port": v.agent.port}]},
        *scrape]))
    return objs


def _scrapers(v: Values) -> list[Obj]:
    """Ingress to /metrics from the pods of ``metricsNamespaces`` (e.g. Prometheus'); none when empty."""
    if not v.metricsPort or not v.metricsNamespaces:
        return []
    return [{"from": [{"namespaceSelector": {"matchExpressions": [{"key": NAMESPACE_NAME_LABEL, "operator": "In",
                                                                   "values": list(v.metricsNamespaces)}]}}],
             "ports": [{"protocol": "TCP", "port": v.metricsPort}]}]


def _priority(v: Values) -> Obj:
    return {"priorityClassName": v.priorityClass.name} if v.priorityClass.name else {}


def _metrics_port(v: Values) -> list[Obj]:
    return [{"name": "metrics", "containerPort": v.metricsPort}] if v.metricsPort else []


def _etcd(v: Values) -> list[Obj]:
    ns, e = v.namespace, v.etcd
    peers = ",".join(f"rota-etcd-{i}=https://rota-etcd-{i}.rota-etcd.{ns}.svc:2380" for i in range(e.replicas))
    # No shell: Kubernetes expands $(POD_NAME) from the container's env. Clients and peers
    # must present a certificate signed by the CA of the members' Secret (mutual TLS).
    command = [
        "etcd", "--name=$(POD_NAME)", "--data-dir=/var/lib/etcd/data",
        "--listen-client-urls=https://0.0.0.0:2379", "--listen-peer-urls=https://0.0.0.0:2380",
        f"--advertise-client-urls=https://$(POD_NAME).rota-etcd.{ns}.svc:2379",
        f"--initial-advertise-peer-urls=https://$(POD_NAME).rota-etcd.{ns}.svc:2380",
        f"--initial-cluster={peers}", "--initial-cluster-state=new", f"--initial-cluster-token=rota-etcd-{ns}",
        "--client-cert-auth=true", f"--trusted-ca-file={ETCD_TLS_DIR}/ca.crt",
        f"--cert-file={ETCD_TLS_DIR}/tls.crt", f"--key-file={ETCD_TLS_DIR}/tls.key",
        "--peer-client-cert-auth=true", f"--peer-trusted-ca-file={ETCD_TLS_DIR}/ca.crt",
        f"--peer-cert-file={ETCD_TLS_DIR}/tls.crt", f"--peer-key-file={ETCD_TLS_DIR}/tls.key",
        f"--listen-metrics-urls=http://0.0.0.0:{ETCD_METRICS_PORT}",
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
                     **_priority(v),
                     "securityContext": {"runAsNonRoot": True, "fsGroup": 65532, "seccompProfile": _RUNTIME_DEFAULT},
                     "affinity": _spread("etcd"),
                     "volumes": [_secret_volume("tls", e.serverSecret)],
                     "containers": [{
                         "name": "etcd", "image": e.image, "imagePullPolicy": v.imagePullPolicy,
                         "command": command,
                         "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                         "ports": [{"name": "client", "containerPort": 2379},
                                   {"name": "peer", "containerPort": 2380},
                                   {"name": "metrics", "containerPort": ETCD_METRICS_PORT}],
                         # The kubelet's gRPC probes speak no TLS: probe etcd's plain /health listener.
                         **_http_probes(ETCD_METRICS_PORT, ready="/health", live="/health?serializable=true",
                                        initial=10),
                         "resources": _resources("100m", "256Mi", e.memoryLimit),
                         "securityContext": dict(_RESTRICTED),
                         "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"},
                                          {"name": "tls", "mountPath": ETCD_TLS_DIR, "readOnly": True}],
                     }],
                 },
             },
             "volumeClaimTemplates": [pvc],
         }},
        # Keep quorum through voluntary disruptions (drains): at most one member down.
        _pdb("rota-etcd", "etcd", ns, maxUnavailable=1),
    ]


def _secret_volume(name: str, secret: str, *, mode: int = 0o440, items: list[Obj] | None = None) -> Obj:
    """A Secret volume: group-readable (the pod's fsGroup) at most, never world-readable."""
    source: Obj = {"secretName": secret, "defaultMode": mode}
    if items:
        source["items"] = items
    return {"name": name, "secret": source}


def _auth_key_volumes(v: Values, *, mode: int) -> list[Obj]:
    """The auth key Secret (only its ``key``), and the memory-backed directory its owner-only copy goes to."""
    return [_secret_volume("auth-secret", v.auth.secretName, mode=mode, items=[{"key": "key", "path": "key"}]),
            {"name": "auth", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}}]


def _install_key(v: Values, security: Obj) -> Obj:
    """Init container: copy the Secret's key to an owner-only file, as ``rota.auth.load_key`` demands.

    Kubernetes mounts a Secret through symbolic links and, for a non-root user, group-readable
    at best; the key file the servers read must be a regular file of mode 0600.
    """
    return {"name": "install-auth-key", "image": v.image, "imagePullPolicy": v.imagePullPolicy,
            "command": ["rota", "--log-level", v.logLevel, "k8s", "install-key", f"{AUTH_SECRET_DIR}/key",
                        f"{AUTH_DIR}/key"],
            "resources": _resources("10m", "32Mi", "64Mi"),
            "securityContext": dict(security),
            "volumeMounts": [{"name": "auth-secret", "mountPath": AUTH_SECRET_DIR, "readOnly": True},
                             {"name": "auth", "mountPath": AUTH_DIR}]}


_AUTH_MOUNT = {"name": "auth", "mountPath": AUTH_DIR, "readOnly": True}


def _spread(component: str) -> Obj:
    return {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
        "weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": _selector(component)}}}]}}


def _api_access_volume() -> Obj:
    """What automounting the service account token gives, as a volume mounted into the controller only."""
    return {"name": "kube-api-access", "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}


def _orchestrator(v: Values) -> list[Obj]:
    ns, o = v.namespace, v.orchestrator
    serve = ["rota", "--log-level", v.logLevel, "orchestrator", "serve", "--listen", "0.0.0.0:50051",
             "--auth-key", f"{AUTH_DIR}/key",
             "--etcd", ",".join(v.etcd_urls()), "--policy", o.policy, "--ttl", _num(o.ttl),
             "--park-timeout", _num(o.parkTimeout), "--max-turn", _num(o.maxTurn)]
    if v.metricsPort:
        serve += ["--metrics-listen", f"0.0.0.0:{v.metricsPort}", "--metrics-hash-ids"]  # scraped without a token
    controller = ["rota", "--log-level", v.logLevel, "k8s", "controller",
                  "--orchestrator", v.orchestrator_address(), "--auth-key", f"{AUTH_DIR}/key",
                  "--token-ttl", v.auth.tokenTtl, "--max-priority", str(v.auth.maxPriority),
                  "--health-listen", f"0.0.0.0:{CONTROLLER_HEALTH_PORT}"]
    for tenant_ns in v.tenantNamespaces:
        controller += ["--namespace", tenant_ns]
    # A follower redirects clients to the leader's advertised address: its pod IP (the
    # NetworkPolicy admits tenants to every replica), not the Service, which may pick a follower.
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "ROTA_ADVERTISE", "value": "$(POD_IP):50051"}]
    env += [{"name": f"ROTA_ETCD_{part.upper()}", "value": f"{ETCD_CLIENT_DIR}/{file}"}
            for part, file in (("ca", "ca.crt"), ("cert", "tls.crt"), ("key", "tls.key"))]
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
                     "automountServiceAccountToken": False,
                     **_priority(v),
                     # fsGroup: the Secrets' files are readable by the pod's group (mode 0440), not by all.
                     "securityContext": {"runAsNonRoot": True, "fsGroup": 65532, "seccompProfile": _RUNTIME_DEFAULT},
                     "affinity": _spread("orchestrator"),
                     "volumes": [*_auth_key_volumes(v, mode=0o440), _secret_volume("etcd-tls", v.etcd.clientSecret),
                                 _api_access_volume()],
                     "initContainers": [_install_key(v, _RESTRICTED)],
                     "containers": [
                         {
                             # Replicas elect a leader through etcd; only the leader grants, and the
                             # fencing token proves it. Readiness (grpc health of the orchestrator
                             # service) is SERVING on every replica that answers: the leader, and
                             # followers that know it (they serve status from etcd and send the rest
                             # to the leader with a rota-leader trailer, which clients follow). So a
                             # rollout's new pod becomes ready as a follower, and a drain may take
                             # either. Which one leads: grpc health "rota.leader", the metric
                             # rota_orchestrator_leader, `kubectl rota status`. Liveness: "" (the process).
                             "name": "orchestrator", "image": v.image, "imagePullPolicy": v.imagePullPolicy,
                             "command": serve, "env": env,
                             "ports": [{"name": "grpc", "containerPort": 50051}, *_metrics_port(v)],
                             **_grpc_probes(50051, ready_service=ORCHESTRATOR_SERVICE),
                             "resources": _resources("100m", "128Mi", o.memoryLimit),
                             "securityContext": dict(_RESTRICTED),
                             "volumeMounts": [_AUTH_MOUNT, {"name": "etcd-tls", "mountPath": ETCD_CLIENT_DIR,
                                                            "readOnly": True}],
                         },
                         {
                             # Issues each tenant job's token into a Secret of its namespace, and
                             # releases the turns of tenant pods that are deleted, evicted or whose
                             # node is lost. Evict is idempotent, so every replica may run one.
                             # Liveness only: /healthz is 503 once no list or watch of the API server has
                             # succeeded for 3 watch timeouts (3 min), and the kubelet restarts this
                             # container. No readiness probe: the pod's readiness is the orchestrator's,
                             # which serves tenants whether or not the API server answers.
                             "name": "controller", "image": v.image, "imagePullPolicy": v.imagePullPolicy,
                             "command": controller,
                             "ports": [{"name": "health", "containerPort": CONTROLLER_HEALTH_PORT}],
                             "livenessProbe": {"httpGet": {"port": CONTROLLER_HEALTH_PORT, "path": "/healthz"},
                                               "initialDelaySeconds": 15, "periodSeconds": 10, "failureThreshold": 6},
                             "resources": _resources("20m", "64Mi", "256Mi"),
                             "securityContext": dict(_RESTRICTED),
                             "volumeMounts": [_AUTH_MOUNT, {"name": "kube-api-access", "mountPath": SA_TOKEN_DIR,
                                                            "readOnly": True}],
                         },
                     ],
                 },
             },
         }},
        # One replica at a time may go (a drain, a node upgrade); the other keeps answering
        # and, if the leader went, takes over within the election TTL.
        _pdb("rota-orchestrator", "orchestrator", ns, maxUnavailable=1),
    ]


AGENT_CLAIM = "gpus"  # the agent pod's claim (DRA admin access to every GPU of its node)


def _agent_gpu_claim(v: Values) -> Obj:
    """A ResourceClaimTemplate: each agent pod gets admin access to all GPUs of class gpu.nvidia.com on its node.

    Admin access (``adminAccess: true``, for monitoring and management services) sees the
    devices without taking them from the tenants' own claims; Kubernetes grants it only in
    namespaces labelled ``resource.kubernetes.io/admin-access=true`` (the agent's).
    """
    return {"apiVersion": CLAIM_API_VERSION, "kind": "ResourceClaimTemplate",
            "metadata": _meta("rota-agent-gpus", "agent", v.agent_namespace),
            "spec": {"spec": {"devices": {"requests": [{"name": AGENT_CLAIM, "exactly": {
                "deviceClassName": DEVICE_CLASS, "allocationMode": "All", "adminAccess": True}}]}}}}


def _agent(v: Values) -> list[Obj]:
    ns, a = v.agent_namespace, v.agent
    command = ["rota", "--log-level", v.logLevel, "agent", "serve", "--listen", f"$(POD_IP):{a.port}",
               "--auth-key", f"{AUTH_DIR}/key", "--socket-dir", ""]
    if v.metricsPort:
        command += ["--metrics-listen", f"$(POD_IP):{v.metricsPort}", "--metrics-hash-ids"]  # no token to scrape
    env: list[Obj] = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                      {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    resources = _resources("50m", "128Mi", a.memoryLimit)
    if a.gpuAccess == "dra":
        resources["claims"] = [{"name": AGENT_CLAIM}]
    else:  # the NVIDIA container runtime (its RuntimeClass) reads these and mounts every GPU of the node
        env += [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"},
                {"name": "NVIDIA_DRIVER_CAPABILITIES", "value": "compute,utility"}]
    root = {"runAsUser": 0, "runAsNonRoot": False, "privileged": False, "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}, "seccompProfile": _RUNTIME_DEFAULT}
    spec: Obj = {
        "serviceAccountName": "rota-agent",
        "automountServiceAccountToken": False,
        **_priority(v),
        # Whole-process parking acts on tenant processes in other pods of the node.
        "hostPID": True,
        "nodeSelector": dict(a.nodeSelector),
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": _auth_key_volumes(v, mode=0o400),
        # root reads the root-owned 0400 Secret file; the agent runs as root anyway (see below).
        "initContainers": [_install_key(v, root)],
        "containers": [{
            "name": "agent", "image": v.image, "imagePullPolicy": v.imagePullPolicy,
            # Bound to the pod's own address (no hostPort, nothing on the node's interfaces);
            # tenants reach their node's agent through the rota-agent Service (internalTrafficPolicy
            # Local), the NetworkPolicy admits only the orchestrator and tenant pods, and every
            # call carries a token checked against the auth key. No Unix sockets (--socket-dir ""):
            # restricted tenant pods cannot mount a host directory to reach a pid door, so the
            # agent acts on no tenant pid, only through the jobs' WorkloadChannels.
            "command": command,
            "env": env,
            "ports": [{"name": "grpc", "containerPort": a.port}, *_metrics_port(v)],
            **_grpc_probes(a.port),
            "resources": resources,
            "securityContext": {**root, "capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]}},
            "volumeMounts": [_AUTH_MOUNT],
        }],
    }
    if a.runtimeClassName:
        spec["runtimeClassName"] = a.runtimeClassName
    objs: list[Obj] = []
    if a.gpuAccess == "dra":
        spec["resourceClaims"] = [{"name": AGENT_CLAIM, "resourceClaimTemplateName": "rota-agent-gpus"}]
        objs.append(_agent_gpu_claim(v))
    return [
        *objs,
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


def to_yaml(objs: Sequence[Obj]) -> str:
    """A multi-document YAML stream (``---`` separated), as ``kubectl apply -f -`` reads it."""
    return yaml.dump_all(list(objs), Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False)


class _NoAliasDumper(yaml.SafeDumper):
    """Writes shared dicts out in full: ``&id001``/``*id001`` anchors confuse readers of manifests."""

    def ignore_aliases(self, data: Any) -> bool:
        return True
