"""`rota k8s render`: the cluster-side objects are complete, valid, wired up and least-privileged."""

from __future__ import annotations

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
    for o in objs:
        assert o["apiVersion"] and o["kind"] and o["metadata"]["name"], o
        assert o["metadata"]["labels"]["app.kubernetes.io/part-of"] == "rota", o["metadata"]
        if o["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert o["metadata"]["namespace"] == "rota-system", o["metadata"]


def test_the_expected_objects_are_rendered(objs: list[dict[str, Any]]) -> None:
    kinds = sorted((o["kind"], o["metadata"]["name"]) for o in objs)
    assert kinds == sorted([
        ("Namespace", "rota-system"), ("ServiceAccount", "rota-orchestrator"), ("ServiceAccount", "rota-agent"),
        ("ClusterRole", "rota-controller-rota-system"), ("ClusterRoleBinding", "rota-controller-rota-system"),
        ("Service", "rota-etcd"), ("StatefulSet", "rota-etcd"), ("PodDisruptionBudget", "rota-etcd"),
        ("Service", "rota-orchestrator"), ("Deployment", "rota-orchestrator"),
        ("PodDisruptionBudget", "rota-orchestrator"), ("Service", "rota-agent"), ("DaemonSet", "rota-agent")])
    assert objs[0]["kind"] == "Namespace"  # applied first
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


def test_probes_are_grpc_health_on_a_declared_port(objs: list[dict[str, Any]]) -> None:
    probed = 0
    for name, _, spec in pod_specs(objs):
        for c in spec["containers"]:
            if c["name"] == "controller":  # the sidecar serves nothing
                assert "readinessProbe" not in c
                continue
            ports = {p["containerPort"] for p in c["ports"]}
            for probe in ("readinessProbe", "livenessProbe"):
                assert set(c[probe]) - {"initialDelaySeconds", "periodSeconds", "failureThreshold"} == {"grpc"}, \
                    (name, c["name"], probe)
                assert c[probe]["grpc"]["port"] in ports
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
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc.get("privileged", False) is False and sc["allowPrivilegeEscalation"] is False
            assert sc["readOnlyRootFilesystem"] is True and sc["seccompProfile"]["type"] == "RuntimeDefault"
            assert sc["capabilities"]["drop"] == ["ALL"]
            if name == "rota-agent":
                assert sc["capabilities"]["add"] == ["SYS_PTRACE"]
            else:
                assert "add" not in sc["capabilities"] and sc["runAsNonRoot"] is True, (name, c["name"])
    (agent_sa,) = [o for o in by_kind(objs, "ServiceAccount") if o["metadata"]["name"] == "rota-agent"]
    assert agent_sa["automountServiceAccountToken"] is False
    (role,) = by_kind(objs, "ClusterRole")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    (binding,) = by_kind(objs, "ClusterRoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "rota-orchestrator",
                                    "namespace": "rota-system"}]


def test_orchestrator_uses_the_rendered_etcd_and_runs_the_controller(objs: list[dict[str, Any]]) -> None:
    (dep,) = by_kind(objs, "Deployment")
    orch, ctl = dep["spec"]["template"]["spec"]["containers"]
    cmd = orch["command"]
    urls = cmd[cmd.index("--etcd") + 1].split(",")
    assert urls == [f"http://rota-etcd-{i}.rota-etcd.rota-system.svc:2379" for i in range(3)]
    assert ctl["command"][-2:] == ["--orchestrator", "rota-orchestrator.rota-system.svc:50051"]
    (sts,) = by_kind(objs, "StatefulSet")
    etcd_cmd = " ".join(sts["spec"]["template"]["spec"]["containers"][0]["command"])
    assert "--initial-cluster=rota-etcd-0=http://rota-etcd-0.rota-etcd.rota-system.svc:2380," in etcd_cmd


def test_existing_etcd_replaces_the_statefulset() -> None:
    objs = render(load_values(overrides={"etcd": {"endpoints": "http://etcd-a:2379,http://etcd-b:2379"}}))
    assert not [o for o in objs if o["metadata"]["name"] == "rota-etcd"]
    (dep,) = by_kind(objs, "Deployment")
    cmd = dep["spec"]["template"]["spec"]["containers"][0]["command"]
    assert cmd[cmd.index("--etcd") + 1] == "http://etcd-a:2379,http://etcd-b:2379"
    validate_objects(objs, ["1.34"])


def test_schema_validation_names_the_broken_object(objs: list[dict[str, Any]]) -> None:
    import copy

    broken = copy.deepcopy(by_kind(objs, "DaemonSet")[0])
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["port"] = "nine-thousand"
    with pytest.raises(ManifestError, match=r"DaemonSet rota-system/rota-agent: .*livenessProbe"):
        validate_objects([broken], ["1.34"])
    typo = copy.deepcopy(by_kind(objs, "Deployment")[0])
    typo["spec"]["replica"] = 2  # strict: unknown fields are errors
    with pytest.raises(ManifestError, match="Deployment rota-system/rota-orchestrator"):
        validate_objects([typo], ["1.34"])


def _parse_rota_command(argv: list[str]) -> str:
    """Parse ``argv`` with the real ``rota`` CLI (plugins included) without running it; return the leaf."""
    import click

    from rota._plugins import plugin_manager
    from rota.cli.main import cli

    plugin_manager().hook.rota_cli(cli=cli)
    cmd: click.Command = cli
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


def test_rendered_commands_parse_with_the_real_cli(objs: list[dict[str, Any]]) -> None:
    """Flags in the manifests exist and their values are accepted (a renamed flag fails here)."""
    from rota._plugins import plugin_manager

    seen = []
    for _, _, spec in pod_specs(objs):
        for c in spec["containers"]:
            if c["command"][0] != "rota":
                continue
            if c["command"][3:5] == ["agent", "serve"] and "agent" not in _top_commands(plugin_manager()):
                continue  # rota-agent not installed in this environment
            seen.append(_parse_rota_command(c["command"]))
    assert {"rota orchestrator serve", "rota k8s controller"} <= set(seen)


def _top_commands(pm: Any) -> set[str]:
    from rota.cli.main import cli

    pm.hook.rota_cli(cli=cli)
    return set(cli.commands)
