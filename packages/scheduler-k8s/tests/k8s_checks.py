"""Structural checks shared by the manifest tests (not a test module itself)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client

_api = client.ApiClient()


def model_class(obj: dict[str, Any]) -> str:
    """Name of the official client's model class for this object."""
    if obj["apiVersion"] == "resource.k8s.io/v1" and obj["kind"] == "ResourceClaim":
        return "ResourceV1ResourceClaim"  # V1ResourceClaim is the pod-level reference
    return f"V1{obj['kind']}"


def roundtrip(obj: dict[str, Any]) -> dict[str, Any]:
    """Deserialize into the client's model class and serialize back: unknown fields are lost."""
    model = _api.deserialize(json.dumps(obj), model_class(obj), "application/json")
    return _api.sanitize_for_serialization(model)


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(object name, pod template metadata, pod spec) of every workload."""
    out = []
    for o in objs:
        if o["kind"] == "Pod":
            out.append((o["metadata"]["name"], o["metadata"], o["spec"]))
        elif o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
            t = o["spec"]["template"]
            out.append((o["metadata"]["name"], t["metadata"], t["spec"]))
    return out


_RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}


def restricted_problems(spec: dict[str, Any]) -> list[str]:
    """Why a pod spec fails Pod Security's ``restricted`` profile (its published rules, checked here because no
    API server with Pod Security Admission runs in the tests); [] when it passes."""
    p: list[str] = []
    pod_sc = spec.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(key):
            p.append(f"{key} is set")
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= _RESTRICTED_VOLUMES:
            p.append(f"volume {v['name']} is of kind {sorted(kinds)}")
    if (pod_sc.get("seccompProfile") or {}).get("type") == "Unconfined":
        p.append("the pod's seccomp profile is Unconfined")
    if pod_sc.get("runAsUser") == 0:
        p.append("the pod runs as uid 0")
    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        sc, name = c.get("securityContext") or {}, c["name"]
        caps = sc.get("capabilities") or {}
        if sc.get("privileged"):
            p.append(f"{name}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            p.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            p.append(f"{name}: runAsNonRoot is not true")
        if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
            p.append(f"{name}: runs as uid 0")
        seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            p.append(f"{name}: seccomp profile {seccomp!r}")
        if "ALL" not in (caps.get("drop") or []):
            p.append(f"{name}: capabilities do not drop ALL")
        added = set(caps.get("add") or [])
        if added - {"NET_BIND_SERVICE"}:
            p.append(f"{name}: adds capabilities {sorted(added)}")
        if any(port.get("hostPort") for port in c.get("ports") or []):
            p.append(f"{name}: uses a hostPort")
    return p


def pod_env(meta: dict[str, Any], spec: dict[str, Any], *, secrets: dict[tuple[str, str], str] | None = None,
            status: dict[str, str] | None = None) -> dict[str, str]:
    """The first container's environment as the kubelet would give it to a pod with this metadata.

    Downward API ``fieldRef`` values come from ``meta`` (and ``status``), ``secretKeyRef``
    from ``secrets`` ({(name, key): value}; a missing one raises KeyError, as the kubelet
    refuses to start the container), and ``$(VAR)`` refers to variables defined before.
    """
    labels, annotations = meta.get("labels") or {}, meta.get("annotations") or {}
    fields = {"metadata.namespace": meta.get("namespace", "default"), "metadata.name": meta.get("name", ""),
              "status.hostIP": "10.0.0.1", "status.podIP": "10.1.0.7", **(status or {})}
    fields.update({f"metadata.labels['{k}']": v for k, v in labels.items()})
    fields.update({f"metadata.annotations['{k}']": v for k, v in annotations.items()})
    env: dict[str, str] = {}
    for e in spec["containers"][0]["env"]:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e["valueFrom"]:
            env[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            ref = e["valueFrom"]["secretKeyRef"]
            env[e["name"]] = (secrets or {})[(ref["name"], ref["key"])]
    return env


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    """Poll ``predicate`` until it is truthy; fail naming ``what`` after ``timeout`` (a hang guard)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out waiting for {what}")
