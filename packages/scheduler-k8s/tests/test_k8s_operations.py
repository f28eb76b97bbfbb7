"""Operating the rendered install: rollouts and drains, resources and priority, the agent's GPUs, /metrics,
image references and --kube-version errors."""

from __future__ import annotations

from typing import Any

import pytest
from click.testing import CliRunner
from k8s_checks import pod_specs

from rota_k8s import ValuesError, load_values, render, validate_objects
from rota_k8s._image import default_image, image_problem
from rota_k8s.cli import k8s
from rota_k8s.manifests import LEADER_HEALTH, ORCHESTRATOR_SERVICE
from rota_k8s.workloads import TenantSpec, tenant


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return render(load_values())


def one(objs: list[dict[str, Any]], kind: str, name: str = "") -> dict[str, Any]:
    (o,) = [o for o in objs if o["kind"] == kind and (not name or o["metadata"]["name"] == name)]
    return o


def containers(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, c) for name, _, spec in pod_specs(objs)
            for c in [*spec.get("initContainers", []), *spec["containers"]]]


def test_orchestrator_rollout_and_drain_can_finish(objs: list[dict[str, Any]]) -> None:
    """The surge pod must become ready as a follower (readiness is the orchestrator service's health, which
    followers report SERVING: see test_k8s_readiness), and the PDB must allow one replica to go."""
    dep = one(objs, "Deployment", "rota-orchestrator")
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxUnavailable": 0, "maxSurge": 1}
    orch = dep["spec"]["template"]["spec"]["containers"][0]
    assert orch["readinessProbe"]["grpc"] == {"port": 50051, "service": ORCHESTRATOR_SERVICE}
    assert orch["livenessProbe"]["grpc"] == {"port": 50051}
    assert one(objs, "PodDisruptionBudget", "rota-orchestrator")["spec"]["maxUnavailable"] == 1
    # followers redirect to the leader's own pod address, reachable by tenants (NetworkPolicy: every replica)
    env = {e["name"]: e for e in orch["env"]}
    assert env["ROTA_ADVERTISE"]["value"] == "$(POD_IP):50051"
    assert [e["name"] for e in orch["env"]].index("POD_IP") < [e["name"] for e in orch["env"]].index("ROTA_ADVERTISE")
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    assert LEADER_HEALTH == "rota.leader"


def test_every_container_has_requests_and_a_memory_limit_and_rota_pods_a_priority(objs: list[dict[str, Any]]) -> None:
    for name, c in containers(objs):
        assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"], (name, c["name"])
        assert c["resources"]["limits"]["memory"], (name, c["name"])
    for name, _, spec in pod_specs(objs):
        assert spec["priorityClassName"] == "rota-critical", name
    pc = one(objs, "PriorityClass")
    assert pc["metadata"]["name"] == "rota-critical" and 0 < pc["value"] <= 1_000_000_000
    assert pc["globalDefault"] is False
    tuned = render(load_values(overrides={"agent": {"memoryLimit": "3Gi"},
                                          "priorityClass": {"name": "system-node-critical", "create": False}}))
    assert not [o for o in tuned if o["kind"] == "PriorityClass"]
    (agent,) = [c for name, c in containers(tuned) if c["name"] == "agent"]
    assert agent["resources"]["limits"]["memory"] == "3Gi"


def test_agent_gets_every_gpu_of_its_node_through_a_dra_admin_claim(objs: list[dict[str, Any]]) -> None:
    tmpl = one(objs, "ResourceClaimTemplate")
    (req,) = tmpl["spec"]["spec"]["devices"]["requests"]
    assert req["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All", "adminAccess": True}
    agent_ns = one(objs, "Namespace", "rota-system-agent")
    assert agent_ns["metadata"]["labels"]["resource.kubernetes.io/admin-access"] == "true"
    assert "resource.kubernetes.io/admin-access" not in one(objs, "Namespace", "rota-system")["metadata"]["labels"]
    spec = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert spec["resourceClaims"] == [{"name": req["name"], "resourceClaimTemplateName": tmpl["metadata"]["name"]}]
    (agent,) = spec["containers"]
    assert agent["resources"]["claims"] == [{"name": req["name"]}]
    assert "NVIDIA_VISIBLE_DEVICES" not in {e["name"] for e in agent["env"]}


def test_runtime_class_access_is_explicit() -> None:
    with pytest.raises(ValuesError, match=r"agent\.gpuAccess: runtimeClass needs agent\.runtimeClassName"):
        load_values(overrides={"agent": {"gpuAccess": "runtimeClass"}})
    with pytest.raises(ValuesError, match=r"agent\.gpuAccess: .all."):
        load_values(overrides={"agent": {"gpuAccess": "all"}})
    objs = render(load_values(overrides={"agent": {"gpuAccess": "runtimeClass", "runtimeClassName": "nvidia"}}))
    assert not [o for o in objs if o["kind"] == "ResourceClaimTemplate"]
    spec = one(objs, "DaemonSet")["spec"]["template"]["spec"]
    assert spec["runtimeClassName"] == "nvidia" and "resourceClaims" not in spec
    env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    validate_objects(objs, ["1.34"])


def test_metrics_are_served_and_only_named_namespaces_may_scrape(objs: list[dict[str, Any]]) -> None:
    for name, c in containers(objs):
        if c["name"] in ("orchestrator", "agent"):
            assert "--metrics-listen" in c["command"], name
            assert {"name": "metrics", "containerPort": 9464} in c["ports"]
    assert all(9464 not in [p["port"] for r in o["spec"]["ingress"] for p in r["ports"]]
               for o in objs if o["kind"] == "NetworkPolicy")  # no scraper named: only port-forwards reach it
    scraped = render(load_values(overrides={"metricsNamespaces": ["monitoring"]}))
    for name in ("rota-orchestrator", "rota-agent"):
        pol = one(scraped, "NetworkPolicy", name)
        rule = pol["spec"]["ingress"][-1]
        assert rule["ports"] == [{"protocol": "TCP", "port": 9464}]
        assert rule["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["monitoring"]
    off = render(load_values(overrides={"metricsPort": 0}))
    assert not [c for _, c in containers(off) if "--metrics-listen" in c["command"]]
    with pytest.raises(ValuesError, match="metricsPort"):
        load_values(overrides={"metricsPort": 9001})  # the agent's own port


@pytest.mark.parametrize("ref", ["x", "busybox", "library/busybox", "reg.example/rota:0.1.0",
                                 "localhost:5000/team/ppo:v1", "reg.example:443/a/b@sha256:" + "0" * 64])
def test_valid_references_are_accepted_everywhere(ref: str) -> None:
    assert image_problem(ref) is None
    load_values(overrides={"image": ref})
    tenant(TenantSpec(group_id="g", job_id="j", image=ref, command=("true",)))


@pytest.mark.parametrize(("ref", "words"), [("Busybox", "path component 'Busybox'"), ("rota:", "bad tag ''"),
                                            ("a//b", "path component ''"), ("x@sha256:12", "bad digest"),
                                            ("has space:1", "path component 'has space'"), ("", "empty")])
def test_invalid_references_are_refused_the_same_way_everywhere(ref: str, words: str) -> None:
    with pytest.raises(ValuesError, match=words):
        load_values(overrides={"image": ref})
    result = CliRunner().invoke(k8s, ["tenant", "--group", "g", "--image", ref, "--", "true"])
    assert result.exit_code != 0 and words in result.output


def test_default_image_is_what_rota_k8s_image_builds() -> None:
    assert load_values().image == default_image()
    result = CliRunner().invoke(k8s, ["image"])
    assert result.exit_code == 0, result.output
    assert f"-t {default_image()}" in result.output and "Dockerfile" in result.output


@pytest.mark.parametrize(("argv", "words"), [
    (["render", "--kube-version", "1.9"], "'1.9' cannot be checked: rota's manifests need Kubernetes 1.34"),
    (["render", "--kube-version", "banana"], "'banana' is not a Kubernetes version"),
    (["tenant", "--group", "g", "--image", "x", "--kube-version", "1.32", "--", "true"], "'1.32' cannot be checked"),
])
def test_kube_version_errors_are_one_line(argv: list[str], words: str) -> None:
    result = CliRunner().invoke(k8s, argv)
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: --kube-version") and words in lines[0], result.output


def test_kube_version_accepts_patch_and_v_prefix() -> None:
    result = CliRunner().invoke(k8s, ["tenant", "--group", "g", "--image", "x", "--kube-version",
                                           "v1.34.2", "--", "true"])
    assert result.exit_code == 0, result.output
