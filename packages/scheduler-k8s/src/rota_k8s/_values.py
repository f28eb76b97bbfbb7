"""Values of a rota deployment on Kubernetes, and their validation.

``rota k8s render`` takes values from one YAML file (``--values``) and/or flags
(flags win) and turns them into :class:`Values`. Every value is checked here, all
problems are collected, and one :class:`ValuesError` names each bad key, so nothing
is printed for ``kubectl apply`` until the whole set is valid. Unknown keys in the
file are errors too: a typo must not silently fall back to a default.

The keys, their defaults and what each is for: README, 'Values file'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from rota import plugin_manager
from rota.auth import parse_ttl
from rota.errors import ConfigError
from rota.policies import available_policies
from rota_k8s._image import default_image, image_problem
from rota_k8s_controller.names import DNS_LABEL, LABEL_VALUE

__all__ = ["AgentValues", "AuthValues", "EtcdValues", "OrchestratorValues", "PriorityClassValues", "Values",
           "ValuesError", "load_values"]

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_URL = re.compile(r"https://[A-Za-z0-9.-]+(:[0-9]{1,5})?/?")  # fullmatch: etcd is reached over TLS only
PULL_POLICIES = ("Always", "IfNotPresent", "Never")
GPU_ACCESS = ("dra", "runtimeClass")
LOG_LEVELS = ("debug", "info", "warning", "error")


class ValuesError(ConfigError):
    """One or more deployment values are bad; ``problems`` lists ``(key, message)``."""

    def __init__(self, problems: list[tuple[str, str]]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
        super().__init__(f"invalid values ({len(problems)} problem{'s' if len(problems) != 1 else ''}), "
                         f"nothing rendered:\n{lines}")


@dataclass(frozen=True)
class EtcdValues:
    """The etcd that keeps the orchestrator's state: ours (StatefulSet) or an existing one."""

    endpoints: tuple[str, ...] = ()
    replicas: int = 3
    image: str = "registry.k8s.io/etcd:3.5.21-0"
    storage: str = "1Gi"
    storageClassName: str = ""
    memoryLimit: str = "2Gi"
    serverSecret: str = "rota-etcd-server"
    clientSecret: str = "rota-etcd-client"


@dataclass(frozen=True)
class AuthValues:
    """Where the auth key is (a Secret made by the operator, never rendered) and how long job tokens live."""

    secretName: str = "rota-auth"
    tokenTtl: str = "30d"
    maxPriority: int = 0  # the highest ROTA_PRIORITY a job's token allows (rota k8s controller --max-priority)


@dataclass(frozen=True)
class OrchestratorValues:
    """The orchestrator Deployment: replicas (leader-elected through etcd) and timing."""

    replicas: int = 2
    policy: str = "fifo"
    ttl: float = 10.0
    parkTimeout: float = 120.0
    maxTurn: float = 0.0
    memoryLimit: str = "1Gi"


@dataclass(frozen=True)
class AgentValues:
    """The per-GPU-node snapshot agent DaemonSet, in a namespace of its own."""

    namespace: str = ""
    port: int = 9001
    nodeSelector: dict[str, str] = field(default_factory=lambda: {"nvidia.com/gpu.present": "true"})
    gpuAccess: str = "dra"
    runtimeClassName: str = ""
    memoryLimit: str = "1Gi"


@dataclass(frozen=True)
class PriorityClassValues:
    """The PriorityClass of rota's own pods (a node's agent must not be preempted by the tenants it serves)."""

    name: str = "rota-critical"
    value: int = 1_000_000
    create: bool = True


@dataclass(frozen=True)
class Values:
    """Everything ``rota k8s render`` needs. Build with :func:`load_values` (validates)."""

    namespace: str = "rota-system"
    image: str = field(default_factory=default_image)
    imagePullPolicy: str = "IfNotPresent"
    logLevel: str = "info"
    metricsPort: int = 9464
    metricsNamespaces: tuple[str, ...] = ()
    tenantNamespaces: tuple[str, ...] = ("default",)
    priorityClass: PriorityClassValues = field(default_factory=PriorityClassValues)
    auth: AuthValues = field(default_factory=AuthValues)
    etcd: EtcdValues = field(default_factory=EtcdValues)
    orchestrator: OrchestratorValues = field(default_factory=OrchestratorValues)
    agent: AgentValues = field(default_factory=AgentValues)

    @property
    def external_etcd(self) -> bool:
        """True when the user points at an existing etcd (no StatefulSet is rendered)."""
        return bool(self.etcd.endpoints)

    def etcd_urls(self) -> list[str]:
        """Client URLs the orchestrator is given (ours, through the headless Service, or theirs)."""
        if self.etcd.endpoints:
            return list(self.etcd.endpoints)
        return [f"https://rota-etcd-{i}.rota-etcd.{self.namespace}.svc:2379" for i in range(self.etcd.replicas)]

    @property
    def agent_namespace(self) -> str:
        """Namespace of the agent DaemonSet: the only one that must allow privileged pods."""
        return self.agent.namespace or f"{self.namespace}-agent"

    def orchestrator_address(self) -> str:
        """In-cluster address of the orchestrator Service, for tenants and the controller."""
        return f"rota-orchestrator.{self.namespace}.svc:50051"


_SECTIONS: dict[str, type] = {"auth": AuthValues, "etcd": EtcdValues, "orchestrator": OrchestratorValues,
                              "agent": AgentValues, "priorityClass": PriorityClassValues}


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "nodeSelector":
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def load_values(file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Values:
    """Read ``file`` (YAML), apply ``overrides`` (same nested shape, from flags), validate.

    :raises ValuesError: naming every bad or unknown key, or the file if it is not YAML.
    """
    data: dict[str, Any] = {}
    if file is not None:
        try:
            loaded = yaml.safe_load(Path(file).read_text())
        except OSError as exc:
            raise ValuesError([("--values", f"cannot read {file}: {exc.strerror or exc}")]) from None
        except yaml.YAMLError as exc:
            raise ValuesError([("--values", f"{file} is not valid YAML: {exc}")]) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValuesError([("--values", f"{file} must hold a mapping at the top, not {type(loaded).__name__}")])
        data = loaded
    data = _merge(data, overrides or {})
    return _build(data)


def _build(data: dict[str, Any]) -> Values:
    problems: list[tuple[str, str]] = []
    top_known = {f for f in Values.__dataclass_fields__}
    for key in sorted(set(data) - top_known):
        problems.append((str(key), f"unknown key; known keys are {', '.join(sorted(top_known))}"))
    sections: dict[str, Any] = {}
    for name, cls in _SECTIONS.items():
        raw = data.get(name, {}) or {}
        if not isinstance(raw, dict):
            problems.append((name, f"must be a mapping, not {type(raw).__name__}"))
            raw = {}
        known = set(cls.__dataclass_fields__)
        for key in sorted(set(raw) - known):
            problems.append((f"{name}.{key}", f"unknown key; known keys are {', '.join(sorted(known))}"))
        sections[name] = {k: v for k, v in raw.items() if k in known}
    top = {k: v for k, v in data.items() if k in top_known and k not in _SECTIONS}

    values = Values()
    values = replace(values, **{k: _typed(problems, k, v, getattr(values, k)) for k, v in top.items()})
    for name, cls in _SECTIONS.items():
        default = cls()
        typed = {k: _typed(problems, f"{name}.{k}", v, getattr(default, k)) for k, v in sections[name].items()}
        values = replace(values, **{name: replace(default, **typed)})
    problems.extend(_check(values))
    if problems:
        raise ValuesError(problems)
    return values


def _typed(problems: list[tuple[str, str]], key: str, value: Any, default: Any) -> Any:
    """Coerce ``value`` to the type of ``default``; record a problem and keep the default if it can't be."""
    try:
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            raise TypeError
        if isinstance(default, int):
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            return int(value)
        if isinstance(default, float):
            if isinstance(value, bool):
                raise TypeError
            return float(value)
        if isinstance(default, str):
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise TypeError
            return str(value)
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                raise TypeError
            return tuple(value)
        if isinstance(default, dict):
            if not isinstance(value, dict):
                raise TypeError
            return {str(k): str(v) for k, v in value.items()}
    except (TypeError, ValueError):
        problems.append((key, f"{value!r} is not a {type(default).__name__}"))
        return default
    return value


def _check(v: Values) -> list[tuple[str, str]]:
    p: list[tuple[str, str]] = []
    for key, image in (("image", v.image), ("etcd.image", v.etcd.image)):
        problem = image_problem(image)
        if problem:
            p.append((key, f"{image!r} is not a container image reference: it {problem}"))
    for key, quantity in (("etcd.memoryLimit", v.etcd.memoryLimit), ("agent.memoryLimit", v.agent.memoryLimit),
                          ("orchestrator.memoryLimit", v.orchestrator.memoryLimit)):
        if not _QUANTITY.fullmatch(quantity):
            p.append((key, f"{quantity!r} is not a Kubernetes quantity (e.g. 1Gi)"))
    if v.metricsPort and (not 1024 <= v.metricsPort <= 65535 or v.metricsPort in (50051, v.agent.port)):
        p.append(("metricsPort", f"{v.metricsPort} must be 0 (no /metrics) or a free port between 1024 and 65535"))
    for ns in v.metricsNamespaces:
        if not DNS_LABEL.fullmatch(ns):
            p.append(("metricsNamespaces", f"{ns!r} is not a namespace name (a DNS-1123 label)"))
    pc = v.priorityClass
    if pc.name and not _DNS_SUBDOMAIN.fullmatch(pc.name):
        p.append(("priorityClass.name", f"{pc.name!r} is not a DNS-1123 subdomain"))
    if pc.create and pc.name.startswith("system-"):
        p.append(("priorityClass.name", f"{pc.name!r}: names starting with 'system-' are Kubernetes' own; set "
                  "priorityClass.create to false to use it"))
    if not 0 <= pc.value <= 1_000_000_000:
        p.append(("priorityClass.value", f"{pc.value} must be between 0 and 1000000000 (higher is reserved for "
                  "system classes)"))
    if v.imagePullPolicy not in PULL_POLICIES:
        p.append(("imagePullPolicy", f"{v.imagePullPolicy!r}; choose one of {', '.join(PULL_POLICIES)}"))
    if v.logLevel not in LOG_LEVELS:
        p.append(("logLevel", f"{v.logLevel!r}; choose one of {', '.join(LOG_LEVELS)}"))
    for url in v.etcd.endpoints:
        if not _URL.fullmatch(url):
            p.append(("etcd.endpoints", f"{url!r} is not an https:// etcd client URL (e.g. https://etcd.example:2379): "
                      "rota's state is only reached over TLS with a client certificate (etcd.clientSecret)"))
    for key, name in (("etcd.serverSecret", v.etcd.serverSecret), ("etcd.clientSecret", v.etcd.clientSecret),
                      ("auth.secretName", v.auth.secretName)):
        if not _DNS_SUBDOMAIN.fullmatch(name):
            p.append((key, f"{name!r} is not a Secret name (a DNS-1123 subdomain)"))
    try:
        parse_ttl(v.auth.tokenTtl)
    except ConfigError:
        p.append(("auth.tokenTtl", f"{v.auth.tokenTtl!r} is not a duration of at most a year (e.g. 30d, 12h)"))
    if not isinstance(v.auth.maxPriority, int) or isinstance(v.auth.maxPriority, bool) \
            or not 0 <= v.auth.maxPriority <= 1000:
        p.append(("auth.maxPriority", f"{v.auth.maxPriority!r} is not a whole number from 0 to 1000"))
    p.extend(_namespace_problems(v))
    if not v.etcd.endpoints:
        if v.etcd.replicas < 1 or v.etcd.replicas % 2 == 0 or v.etcd.replicas > 9:
            p.append(("etcd.replicas", f"{v.etcd.replicas} must be odd and between 1 and 9 "
                      "(an even member count adds no fault tolerance)"))
        if not _QUANTITY.fullmatch(v.etcd.storage):
            p.append(("etcd.storage", f"{v.etcd.storage!r} is not a Kubernetes quantity (e.g. 1Gi)"))
        if v.etcd.storageClassName and not _DNS_SUBDOMAIN.fullmatch(v.etcd.storageClassName):
            p.append(("etcd.storageClassName", f"{v.etcd.storageClassName!r} is not a DNS-1123 subdomain"))
    o = v.orchestrator
    if not 1 <= o.replicas <= 9:
        p.append(("orchestrator.replicas", f"{o.replicas} must be between 1 and 9"))
    policies = sorted(available_policies(plugin_manager()))  # built-in and every installed plugin's
    if o.policy not in policies:
        p.append(("orchestrator.policy", f"{o.policy!r}; choose one of {', '.join(policies)} (policies of the "
                  "plugins installed here, which the image must also have)"))
    if not 0 < o.ttl <= 3600:
        p.append(("orchestrator.ttl", f"{o.ttl} seconds must be > 0 and <= 3600"))
    if not 0 < o.parkTimeout <= 3600:
        p.append(("orchestrator.parkTimeout", f"{o.parkTimeout} seconds must be > 0 and <= 3600"))
    if not 0 <= o.maxTurn <= 86400:
        p.append(("orchestrator.maxTurn", f"{o.maxTurn} seconds must be >= 0 (0 = no limit) and <= 86400"))
    a = v.agent
    if not 1024 <= a.port <= 65535:
        p.append(("agent.port", f"{a.port} must be between 1024 and 65535"))
    for k, val in a.nodeSelector.items():
        name = k.rsplit("/", 1)[-1]
        prefix = k.rsplit("/", 1)[0] if "/" in k else ""
        if not _LABEL_NAME.fullmatch(name) or (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix)):
            p.append(("agent.nodeSelector", f"{k!r} is not a label key"))
        if not LABEL_VALUE.fullmatch(val):
            p.append(("agent.nodeSelector", f"{k}={val!r}: value is not a label value"))
    if a.runtimeClassName and not _DNS_SUBDOMAIN.fullmatch(a.runtimeClassName):
        p.append(("agent.runtimeClassName", f"{a.runtimeClassName!r} is not a DNS-1123 subdomain"))
    if a.gpuAccess not in GPU_ACCESS:
        p.append(("agent.gpuAccess", f"{a.gpuAccess!r}; choose dra (a DRA admin-access claim, Kubernetes 1.34+) or "
                  "runtimeClass (with agent.runtimeClassName)"))
    elif a.gpuAccess == "runtimeClass" and not a.runtimeClassName:
        p.append(("agent.gpuAccess", "runtimeClass needs agent.runtimeClassName (e.g. nvidia): without the NVIDIA "
                  "runtime, NVIDIA_VISIBLE_DEVICES gives the agent no GPU"))
    return p


def _namespace_problems(v: Values) -> list[tuple[str, str]]:
    """rota's two namespaces and the tenants' must be valid and apart: a tenant in rota's namespace could
    mount the auth key Secret, one in the agent's would escape Pod Security's restricted profile."""
    p: list[tuple[str, str]] = []
    what = "is not a DNS-1123 label (lowercase letters, digits, '-', at most 63, starting and ending with a " \
           "letter or digit)"
    if not DNS_LABEL.fullmatch(v.namespace):
        p.append(("namespace", f"{v.namespace!r} {what}"))
        if not v.agent.namespace:
            return p  # the agent's, derived from it, is bad for the same reason
    if not DNS_LABEL.fullmatch(v.agent_namespace):
        p.append(("agent.namespace", f"{v.agent_namespace!r} {what}; set agent.namespace to a shorter name"))
    elif v.agent_namespace == v.namespace:
        p.append(("agent.namespace", f"{v.agent_namespace!r} is rota's own namespace; the agent needs a namespace of "
                  "its own (Pod Security 'privileged'), so the rest of rota stays 'restricted'"))
    if not v.tenantNamespaces:
        p.append(("tenantNamespaces", "is empty: name at least one namespace whose pods may use rota"))
    for ns in v.tenantNamespaces:
        if not DNS_LABEL.fullmatch(ns):
            p.append(("tenantNamespaces", f"{ns!r} {what}"))
        elif ns in (v.namespace, v.agent_namespace):
            p.append(("tenantNamespaces", f"{ns!r} is one of rota's own namespaces; run tenants in another one"))
    if len(set(v.tenantNamespaces)) != len(v.tenantNamespaces):
        p.append(("tenantNamespaces", "names a namespace twice"))
    return p
