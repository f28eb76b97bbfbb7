"""Deployment values: bad ones are rejected with errors naming them, before anything is printed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from rota import hookimpl, plugin_manager
from rota_k8s import ValuesError, load_values, render
from rota_k8s.cli import k8s


@pytest.mark.parametrize(("overrides", "key", "words"), [
    ({"namespace": "Rota_System"}, "namespace", "DNS-1123"),
    ({"image": "has space:1"}, "image", "image reference"),
    ({"imagePullPolicy": "Sometimes"}, "imagePullPolicy", "IfNotPresent"),
    ({"etcd": {"replicas": 2}}, "etcd.replicas", "odd"),
    ({"etcd": {"endpoints": ["etcd:2379"]}}, "etcd.endpoints", "client URL"),
    ({"etcd": {"endpoints": ["http://etcd:2379"]}}, "etcd.endpoints", "only reached over TLS"),
    ({"etcd": {"endpoints": ["https://etcd:2379\n"]}}, "etcd.endpoints", "client URL"),
    ({"etcd": {"clientSecret": "Etcd_Client"}}, "etcd.clientSecret", "Secret name"),
    ({"auth": {"secretName": ""}}, "auth.secretName", "Secret name"),
    ({"auth": {"tokenTtl": "forever"}}, "auth.tokenTtl", "duration"),
    ({"tenantNamespaces": []}, "tenantNamespaces", "at least one"),
    ({"tenantNamespaces": ["team-a", "Team_B"]}, "tenantNamespaces", "DNS-1123"),
    ({"tenantNamespaces": ["rota-system"]}, "tenantNamespaces", "rota's own"),
    ({"tenantNamespaces": ["rota-system-agent"]}, "tenantNamespaces", "rota's own"),
    ({"tenantNamespaces": ["a", "a"]}, "tenantNamespaces", "twice"),
    ({"agent": {"namespace": "rota-system"}}, "agent.namespace", "of its own"),
    ({"namespace": "n" * 60}, "agent.namespace", "shorter"),
    ({"etcd": {"storage": "lots"}}, "etcd.storage", "quantity"),
    ({"orchestrator": {"replicas": 0}}, "orchestrator.replicas", "between 1 and 9"),
    ({"orchestrator": {"policy": "lifo"}}, "orchestrator.policy", "fair, fifo, priority"),
    ({"orchestrator": {"ttl": 0}}, "orchestrator.ttl", "> 0"),
    ({"orchestrator": {"parkTimeout": "soon"}}, "orchestrator.parkTimeout", "not a float"),
    ({"orchestrator": {"maxTurn": -1}}, "orchestrator.maxTurn", ">= 0"),
    ({"agent": {"port": 80}}, "agent.port", "1024"),
    ({"agent": {"nodeSelector": {"gpu": "yes please"}}}, "agent.nodeSelector", "label value"),
    ({"agent": {"nodeSelector": ["gpu"]}}, "agent.nodeSelector", "not a dict"),
    ({"agent": {"runtimeClassName": "NVIDIA"}}, "agent.runtimeClassName", "DNS-1123"),
    ({"replicas": 3}, "replicas", "unknown key"),
    ({"etcd": {"replica": 3}}, "etcd.replica", "unknown key"),
    ({"orchestrator": "big"}, "orchestrator", "mapping"),
])
def test_each_bad_value_is_named(overrides: dict[str, Any], key: str, words: str) -> None:
    with pytest.raises(ValuesError) as info:
        load_values(overrides=overrides)
    assert [k for k, _ in info.value.problems] == [key]
    assert words in info.value.problems[0][1]
    assert f"  {key}: " in str(info.value)


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ValuesError) as info:
        load_values(overrides={"namespace": "X", "orchestrator": {"ttl": -1, "policy": "x"}})
    assert {k for k, _ in info.value.problems} == {"namespace", "orchestrator.ttl", "orchestrator.policy"}


def test_values_file_and_flags_combine_with_flags_winning(tmp_path: Path) -> None:
    f = tmp_path / "values.yaml"
    f.write_text(yaml.safe_dump({"namespace": "gpu-share", "image": "reg.example/rota:1",
                                 "orchestrator": {"ttl": 5, "policy": "fair"},
                                 "agent": {"nodeSelector": {"pool": "a100"}}}))
    v = load_values(f, {"orchestrator": {"ttl": 7}})
    assert (v.namespace, v.image, v.orchestrator.ttl, v.orchestrator.policy) == ("gpu-share", "reg.example/rota:1",
                                                                                 7.0, "fair")
    assert v.agent.nodeSelector == {"pool": "a100"}
    ds = next(o for o in render(v) if o["kind"] == "DaemonSet")
    assert ds["spec"]["template"]["spec"]["nodeSelector"] == {"pool": "a100"}


@pytest.mark.parametrize(("content", "words"), [("a: [1, 2", "not valid YAML"), ("- 1\n- 2\n", "mapping")])
def test_unreadable_values_file_is_named(tmp_path: Path, content: str, words: str) -> None:
    f = tmp_path / "v.yaml"
    f.write_text(content)
    with pytest.raises(ValuesError, match=words) as info:
        load_values(f)
    assert info.value.problems[0][0] == "--values"


def test_cli_prints_nothing_on_bad_values(tmp_path: Path, rota_cli: Any) -> None:
    f = tmp_path / "v.yaml"
    f.write_text("namespace: Bad\netcd:\n  replicas: 4\n")
    result = CliRunner().invoke(k8s, ["render", "--values", str(f), "--policy", "lifo"])
    assert result.exit_code == 2
    assert result.stdout == ""
    for key in ("namespace:", "etcd.replicas:", "orchestrator.policy:"):
        assert key in result.stderr


def test_cli_bad_flag_syntax_is_named(rota_cli: Any) -> None:
    result = CliRunner().invoke(k8s, ["render", "--node-selector", "nokey"])
    assert result.exit_code == 2 and "--node-selector" in result.stderr and result.stdout == ""


def test_cli_writes_one_file_per_object_with_output_dir(tmp_path: Path, rota_cli: Any) -> None:
    out = tmp_path / "manifests"
    result = CliRunner().invoke(rota_cli, ["k8s", "render", "-o", str(out), "--namespace", "gpus",
                                      "--etcd", "https://etcd.infra:2379", "--kube-version", "1.34"])
    assert result.exit_code == 0, result.output
    files = sorted(p for p in out.iterdir() if p.name != "kustomization.yaml")
    objs = [yaml.safe_load(p.read_text()) for p in files]
    assert objs == render(load_values(overrides={"namespace": "gpus",
                                                 "etcd": {"endpoints": ["https://etcd.infra:2379"]}}))
    assert files[0].name == "00-namespace-gpus.yaml"
    assert "StatefulSet" not in {o["kind"] for o in objs}
    # a kustomize base of exactly those files, in apply order (kubectl apply -k)
    base = yaml.safe_load((out / "kustomization.yaml").read_text())
    assert base == {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
                    "resources": [p.name for p in files]}
    kubectl = shutil.which("kubectl")
    if kubectl:  # the real kustomize (built into kubectl) builds the base back into the same objects
        built = subprocess.run([kubectl, "kustomize", str(out)], capture_output=True, text=True, timeout=120)
        assert built.returncode == 0, built.stderr
        key = lambda o: (o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])  # noqa: E731
        assert sorted(yaml.safe_load_all(built.stdout), key=key) == sorted(objs, key=key)


def test_cli_stdout_is_an_apply_ready_stream(rota_cli: Any) -> None:
    result = CliRunner().invoke(rota_cli, ["k8s", "render", "--image", "reg.example/rota:2"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert docs == render(load_values(overrides={"image": "reg.example/rota:2"}))


def test_cli_tenant_and_agent_namespaces(rota_cli: Any) -> None:
    result = CliRunner().invoke(rota_cli, ["k8s", "render", "--tenant-namespace", "team-a", "--tenant-namespace",
                                           "team-b", "--agent-namespace", "gpu-agents", "--kube-version", "1.34"])
    assert result.exit_code == 0, result.output
    docs = list(yaml.safe_load_all(result.stdout))
    assert docs == render(load_values(overrides={"tenantNamespaces": ["team-a", "team-b"],
                                                 "agent": {"namespace": "gpu-agents"}}))
    assert {o["metadata"]["namespace"] for o in docs if o["kind"] == "Role"} == {"team-a", "team-b"}
    assert next(o for o in docs if o["kind"] == "DaemonSet")["metadata"]["namespace"] == "gpu-agents"


class _LotteryPolicies:
    """A third party's policy plugin, registered the way an installed distribution's would be."""

    @staticmethod
    @hookimpl
    def rota_register_policies(register):
        register("lottery", lambda max_turn_s=0.0: None)


def test_a_policy_an_installed_plugin_registers_is_accepted():
    pm = plugin_manager()
    with pytest.raises(ValuesError):
        load_values(overrides={"orchestrator": {"policy": "lottery"}})
    pm.register(_LotteryPolicies, name="test-lottery")
    try:
        assert load_values(overrides={"orchestrator": {"policy": "lottery"}}).orchestrator.policy == "lottery"
    finally:
        pm.unregister(name="test-lottery")
