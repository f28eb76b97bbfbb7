"""`rota k8s render`: the cluster-side objects are complete, valid, wired up and least-privileged."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import yaml
from k8s_checks import pod_specs, roundtrip

from rota_k8s import ManifestError, load_values, render, to_yaml, validate_objects
from rota_k8s._validate import supported_versions


@pytest.fixture(scope="module")
def objs() -> list[dict[str, Any]]:
    return render(load_values())


def by_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def test_every_object_has_identity_and_labels(objs: list[dict[str, Any]]) -> None:
    where = {"Role": "default", "RoleBinding": "default"}  # the controller's rights, in the tenant namespace
    for o in objs:
        assert o["apiVersion"] and o["kind"] and o["metadata"]["name"], o
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rota", o["metadata"]
        if o["kind"] in ("Namespace", "PriorityClass"):  # cluster-scoped
            assert "namespace" not in o["metadata"]
        elif o["metadata"]["labels"]["app.kubernetes.io/component"] == "agent":
            assert o["metadata"]["namespace"] == "rota-system-agent", o["metadata"]
        elif o["kind"] != "NetworkPolicy":
            assert o["metadata"]["namespace"] == where.get(o["kind"], "rota-system"), o["metadata"]


def test_the_expected_objects_are_rendered(objs: list[dict[str, Any]]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([
        ("Namespace", "rota-system"), ("Namespace", "rota-system-agent"),
        ("ServiceAccount", "rota-orchestrator"), ("ServiceAccount", "rota-agent"),
        ("Role", "rota-controller-rota-system"), ("RoleBinding", "rota-controller-rota-system"),
        ("NetworkPolicy", "rota-default-deny"), ("NetworkPolicy", "rota-default-deny"),
        ("NetworkPolicy", "rota-etcd"), ("NetworkPolicy", "rota-orchestrator"), ("NetworkPolicy", "rota-agent"),
        ("Service", "rota-etcd"), ("StatefulSet", "rota-etcd"), ("PodDisruptionBudget", "rota-etcd"),
        ("Service", "rota-orchestrator"), ("Deployment", "rota-orchestrator"),
        ("PodDisruptionBudget", "rota-orchestrator"), ("Service", "rota-agent"), ("DaemonSet", "rota-agent"),
        ("PriorityClass", "rota-critical"), ("ResourceClaimTemplate", "rota-agent-gpus")])
    assert [o["kind"] for o in objs[:2]] == ["Namespace", "Namespace"]  # applied first
    assert "Secret" not in {o["kind"] for o in objs}  # keys and certificates are the operator's, never rendered
    assert by_kind(objs, "StatefulSet")[0]["spec"]["replicas"] == 3
    assert by_kind(objs, "Deployment")[0]["spec"]["replicas"] == 2
    svc = next(s for s in by_kind(objs, "Service") if s["metadata"]["name"] == "rota-orchestrator")
    assert svc["spec"]["ports"][0]["port"] == 50051


def test_objects_validate_against_official_schemas_from_1_34(objs: list[dict[str, Any]]) -> None:
    versions = supported_versions()
    assert versions[0] == "1.34"
    assert validate_objects(objs) == versions


def test_objects_survive_the_official_clients_models_unchanged(objs: list[dict[str, Any]]) -> None:
    for o in objs:
        assert roundtrip(o) == o, f"{o['kind']} {o['metadata']['name']} has fields the client does not know"


def test_yaml_stream_parses_back_to_the_same_objects(objs: list[dict[str, Any]]) -> None:
    text = to_yaml(objs)
    assert "&id" not in text and "*id" not in text  # no YAML anchors
    assert list(yaml.safe_load_all(text)) == objs


def test_probes_are_health_checks_on_a_declared_port(objs: list[dict[str, Any]]) -> None:
    """gRPC health where the port speaks plain gRPC; etcd's client port speaks mutual TLS, which the
    kubelet's gRPC probe cannot, so its plain /health listener is probed instead."""
    probed = 0
    for name, _, spec in pod_specs(objs):
        assert all("readinessProbe" not in c for c in spec.get("initContainers", []))
        for c in spec["containers"]:
            if c["name"] == "controller":  # the sidecar serves nothing
                assert "readinessProbe" not in c
                continue
            ports = {p["containerPort"] for p in c["ports"]}
            kind = "httpGet" if name == "rota-etcd" else "grpc"
            for probe in ("readinessProbe", "livenessProbe"):
                assert set(c[probe]) - {"initialDelaySeconds", "periodSeconds", "failureThreshold"} == {kind}, \
                    (name, c["name"], probe)
                assert c[probe][kind]["port"] in ports
                probed += 1
    assert probed == 6  # etcd, orchestrator, agent x readiness, liveness


def test_selectors_match_their_pods(objs: list[dict[str, Any]]) -> None:
    pods = {name: meta["labels"] for name, meta, _ in pod_specs(objs)}
    for o in objs:
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "PodDisruptionBudget"):
            sel = o["spec"]["selector"]["matchLabels"]
        elif o["kind"] == "Service":
            sel = o["spec"]["selector"]
        else:
            continue
        matching = [n for n, labels in pods.items() if sel.items() <= labels.items()]
        assert matching == [o["metadata"]["name"]], (o["kind"], o["metadata"]["name"], matching)


def test_no_privileges_beyond_what_parking_needs(objs: list[dict[str, Any]]) -> None:
    for name, _, spec in pod_specs(objs):
        assert not spec.get("hostNetwork") and not spec.get("hostIPC"), name
        assert spec.get("hostPID", False) == (name == "rota-agent"), name
        assert not any("hostPath" in v for v in spec.get("volumes", [])), name
        assert spec["automountServiceAccountToken"] is False, name
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            sc = c["securityContext"]
            assert sc.get("privileged", False) is False and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True and sc["seccompProfile"]["type"] == "RuntimeDefault"
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert not any("hostPort" in p for p in c.get("ports", [])), (name, c["name"])
            if (name, c["name"]) == ("rota-agent", "agent"):
                assert sc["capabilities"]["add"] == ["SYS_PTRACE"]
            else:
                assert "add" not in sc["capabilities"], (name, c["name"])
                assert sc["runAsNonRoot"] is (name != "rota-agent"), (name, c["name"])
    (agent_sa,) = [o for o in by_kind(objs, "ServiceAccount") if o["metadata"]["name"] == "rota-agent"]
    assert agent_sa["automountServiceAccountToken"] is False
    assert not by_kind(objs, "ClusterRole") and not by_kind(objs, "ClusterRoleBinding")
    (role,) = by_kind(objs, "Role")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
                             {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create", "update", "delete"]}]
    (binding,) = by_kind(objs, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rota-orchestrator",
                                    "namespace": "rota-system"}]
    # Only the controller container gets the API token; the network-facing orchestrator does not.
    (dep,) = by_kind(objs, "Deployment")
    mounts = {c["name"]: {m["mountPath"] for m in c["volumeMounts"]} for c in dep["spec"]["template"]["spec"]
              ["containers"]}
    assert [n for n, paths in mounts.items() if "/var/run/secrets/kubernetes.io/serviceaccount" in paths] == \
        ["controller"]


def test_orchestrator_uses_the_rendered_etcd_and_runs_the_controller(objs: list[dict[str, Any]]) -> None:
    (dep,) = by_kind(objs, "Deployment")
    orch, ctl = dep["spec"]["template"]["spec"]["containers"]
    cmd = orch["command"]
    urls = cmd[cmd.index("--etcd") + 1].split(",")
    assert urls == [f"https://rota-etcd-{i}.rota-etcd.rota-system.svc:2379" for i in range(3)]
    assert ctl["command"][5:] == ["--orchestrator", "rota-orchestrator.rota-system.svc:50051",
                                  "--auth-key", "/etc/rota/auth/key", "--token-ttl", "30d", "--max-priority", "0",
                                  "--health-listen", "0.0.0.0:8081", "--namespace", "default"]
    # the controller's liveness probe is its /healthz; the pod's readiness stays the orchestrator's alone
    assert ctl["livenessProbe"]["httpGet"] == {"port": 8081, "path": "/healthz"} and "readinessProbe" not in ctl
    assert ctl["ports"] == [{"name": "health", "containerPort": 8081}]
    (sts,) = by_kind(objs, "StatefulSet")
    etcd_cmd = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--initial-cluster=rota-etcd-0=https://rota-etcd-0.rota-etcd.rota-system.svc:2380," in etcd_cmd


def test_existing_etcd_replaces_the_statefulset() -> None:
    objs = render(load_values(overrides={"etcd": {"endpoints": "https://etcd-a:2379,https://etcd-b:2379"}}))
    assert not [o for o in objs if o["metadata"]["name"] == "rota-etcd"]
    (dep,) = by_kind(objs, "Deployment")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--etcd") + 1] == "https://etcd-a:2379,https://etcd-b:2379"
    validate_objects(objs, ["1.34"])


def test_schema_validation_names_the_broken_object(objs: list[dict[str, Any]]) -> None:
    import copy

    broken = copy.deepcopy(by_kind(objs, "DaemonSet")[0])
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "nine-thousand"
    with pytest.raises(ManifestError, match=r"DaemonSet rota-system-agent/rota-agent: .*livenessProbe"):
        validate_objects([broken], ["1.34"])
    typo = copy.deepcopy(by_kind(objs, "Deployment")[0])
    typo["spec"]["replica"] = 2  # strict: unknown fields are errors
    with pytest.raises(ManifestError, match="Deployment rota-system/rota-orchestrator"):
        validate_objects([typo], ["1.34"])


def _parse_rota_command(argv: list[str]) -> str:
    """Parse ``argv`` with the real ``rota`` CLI (plugins included) without running it; return the leaf."""
    import click

    from rota.testing import cli_with_plugins

    cmd: click.Command = cli_with_plugins()
    ctx = cmd.make_context(argv[0], argv[1:])
    path = [argv[0]]
    while isinstance(cmd, click.Group):
        with warnings.catch_warnings():  # click 8.2 deprecates protected_args; 8.1 needs it
            warnings.simplefilter("ignore", DeprecationWarning)
            remaining = [*ctx.protected_args, *ctx.args]
        name, sub, rest = cmd.resolve_command(ctx, remaining)
        assert sub is not None, (path, name)
        cmd, path = sub, [*path, name or ""]
        ctx = cmd.make_context(name, rest, parent=ctx)
    return " ".join(path)


SAMPLE_ENV = {"POD_IP": "10.0.0.7", "POD_NAME": "rota-etcd-0"}  # what the kubelet puts for $(VAR)


def _expanded(argv: list[str]) -> list[str]:
    return [re.sub(r"\$\((\w+)\)", lambda m: SAMPLE_ENV[m.group(1)], arg) for arg in argv]


def _rota_commands(objs: list[dict[str, Any]]) -> list[list[str]]:
    return [_expanded(c["command"]) for _, _, spec in pod_specs(objs)
            for c in [*spec.get("initContainers", []), *spec["containers"]] if c["command"][0] == "rota"]


def test_rendered_commands_parse_with_the_real_cli(objs: list[dict[str, Any]]) -> None:
    """Flags in the manifests exist and their values are accepted (a renamed flag fails here)."""
    seen = [_parse_rota_command(cmd) for cmd in _rota_commands(objs) if cmd[3:5] != ["agent", "serve"]]
    assert sorted(seen) == ["rota k8s controller", "rota k8s install-key", "rota k8s install-key",
                            "rota orchestrator serve"]


def test_rendered_agent_command_parses_with_the_real_cli(objs: list[dict[str, Any]]) -> None:
    from rota.testing import cli_with_plugins

    cli = cli_with_plugins()
    if "agent" not in cli.commands:
        pytest.skip("rota-agent is not installed in this environment")
    if "auth_key" not in {p.name for p in cli.commands["agent"].commands["serve"].params}:  # type: ignore[attr-defined]
        pytest.skip("this rota-agent has no --auth-key yet (issue 17's agent part adds it)")
    (cmd,) = [c for c in _rota_commands(objs) if c[3:5] == ["agent", "serve"]]
    assert _parse_rota_command(cmd) == "rota agent serve"
