"""`rota k8s tenant` and rota_place: tenants of a group share one DRA claim and get ROTA_* env."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from k8s_checks import pod_env, pod_specs, restricted_problems, roundtrip

from rota.errors import InvalidArgument
from rota.testing import new_plugin_manager
from rota.types import TurnRequest
from rota_k8s import GROUP_LABEL, JOB_LABEL, TenantSpec, claim_name, tenant, validate_objects


def spec(**kw: Any) -> TenantSpec:
    base: dict[str, Any] = {"group_id": "grp0", "job_id": "ppo-1", "image": "reg.example/ppo:1",
                            "command": ("python", "train.py")}
    return TenantSpec(**{**base, **kw})


def env_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec["containers"][0]["env"]}


def test_tenants_of_a_group_share_one_claim() -> None:
    first = tenant(spec(job_id="ppo-1"))
    second = tenant(spec(job_id="grpo-2", kind="Pod"))
    other = tenant(spec(job_id="sft-3", group_id="grp1"))
    assert first[0] == second[0]  # the same claim object: applying it twice is a no-op
    claim = first[0]
    assert (claim["apiVersion"], claim["kind"]) == ("resource.k8s.io/v1", "ResourceClaim")
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"]["deviceClassName"] == "gpu.nvidia.com"
    names = set()
    for objs in (first, second):
        for _, _, ps in pod_specs(objs):
            (ref,) = ps["resourceClaims"]
            assert ref["resourceClaimName"] == claim["metadata"]["name"] == claim_name("grp0")
            assert ps["containers"][0]["resources"]["claims"] == [{"name": ref["name"]}]
            names.add(ref["resourceClaimName"])
    assert names == {"rota-group-grp0"}
    assert pod_specs(other)[0][2]["resourceClaims"][0]["resourceClaimName"] == "rota-group-grp1"


def test_labels_and_rota_env_from_the_pod() -> None:
    objs = tenant(spec(world_size=4, priority=3, orchestrator="orch.example:50051", namespace="team-a"))
    job = objs[1]
    assert job["kind"] == "Job" and job["spec"]["completionMode"] == "Indexed"
    assert job["spec"]["completions"] == job["spec"]["parallelism"] == 4
    _, meta, ps = pod_specs(objs)[0]
    assert meta["labels"][JOB_LABEL] == "ppo-1" and meta["labels"][GROUP_LABEL] == "grp0"
    env = env_of(ps)
    assert env["ROTA_ORCHESTRATOR"] == "orch.example:50051"
    assert env["ROTA_WORLD_SIZE"] == "4" and env["ROTA_PRIORITY"] == "3"
    assert env["ROTA_K8S_JOB"] == {"fieldRef": {"fieldPath": f"metadata.labels['{JOB_LABEL}']"}}
    assert env["ROTA_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}
    assert env["ROTA_TOKEN"] == {"secretKeyRef": {"name": "rota-token-ppo-1", "key": "token"}}
    assert env["ROTA_AGENT"] == "rota-agent.rota-system-agent.svc:9001"
    # what the process sees: rota's ids are namespace.label, from the pod itself
    seen = pod_env({**job["metadata"], "annotations": {"batch.kubernetes.io/job-completion-index": "2"}}, ps,
                   secrets={("rota-token-ppo-1", "token"): "T"})
    assert (seen["ROTA_GROUP"], seen["ROTA_TENANT"], seen["ROTA_RANK"], seen["ROTA_TOKEN"]) == \
        ("team-a.grp0", "team-a.ppo-1", "2", "T")


def test_tenant_pods_run_as_non_root_without_privileges() -> None:
    (_, _, ps), = pod_specs(tenant(spec(run_as_user=4242)))
    assert ps["securityContext"]["runAsUser"] == 4242 and ps["automountServiceAccountToken"] is False
    assert restricted_problems(ps) == []
    with pytest.raises(InvalidArgument, match="never run as root"):
        tenant(spec(run_as_user=0))
    (_, _, plain), = pod_specs(tenant(spec(token=False)))
    assert "ROTA_TOKEN" not in env_of(plain)


@pytest.mark.parametrize("kind", ["Job", "Pod"])
def test_tenant_objects_validate_and_roundtrip(kind: str) -> None:
    objs = tenant(spec(kind=kind))
    validate_objects(objs)
    for o in objs:
        assert roundtrip(o) == o


@pytest.mark.parametrize(("kw", "words"), [
    ({"group_id": "team:a"}, "label value"),
    ({"job_id": ""}, "job id is empty"),
    ({"group_id": "x" * 64}, "label value"),
    ({"kind": "Pod", "world_size": 2}, "needs kind Job"),
    ({"command": ()}, "after '--'"),
    ({"env": {"ROTA_GROUP": "other"}}, "set by rota"),
    ({"env": {"ROTA_TOKEN": "forged"}}, "set by rota"),
    ({"namespace": "Team_A"}, "DNS-1123"),
])
def test_bad_tenants_are_refused_with_the_reason(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        tenant(spec(**kw))


def test_rota_place_answers_for_k8s_only() -> None:
    pm = new_plugin_manager()
    assert pm.get_plugin("rota_k8s") is not None, "the entry point did not register rota_k8s.plugin"
    req = TurnRequest(job_id="ppo-1", group_id="grp0")
    placement = pm.hook.rota_place(request=req, scheduler="k8s")
    assert placement.scheduler == "k8s" and placement.group_id == "grp0"
    assert placement.details["resourceClaimName"] == "rota-group-grp0"
    assert placement.details["deviceClassName"] == "gpu.nvidia.com"
    assert placement.details["resourceClaimApiVersion"] == "resource.k8s.io/v1"
    from rota_k8s import plugin

    assert plugin.rota_place(request=req, scheduler="slurm") is None


def test_cli_renders_claim_and_job(rota_cli: Any) -> None:
    result = CliRunner().invoke(rota_cli, ["k8s", "tenant", "--group", "grp0", "--image", "reg.example/ppo:1",
                                      "--job-id", "ppo-1", "--ranks", "2", "--", "python", "train.py", "--lr",
                                      "1e-5"])
    assert result.exit_code == 0, result.output
    claim, job = yaml.safe_load_all(result.stdout)
    assert claim["kind"] == "ResourceClaim" and job["kind"] == "Job"
    assert job["spec"]["template"]["spec"]["containers"][0]["command"] == ["python", "train.py", "--lr", "1e-5"]
    assert job == tenant(spec(world_size=2, command=("python", "train.py", "--lr", "1e-5")))[1]


def test_cli_existing_claim_is_referenced_not_rendered(rota_cli: Any) -> None:
    result = CliRunner().invoke(rota_cli, ["k8s", "tenant", "--group", "grp0", "--image", "img:1", "--kind", "pod",
                                      "--claim", "team-gpu", "--", "sleep", "1"])
    assert result.exit_code == 0, result.output
    (pod,) = yaml.safe_load_all(result.stdout)
    assert pod["spec"]["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "team-gpu"}]


def test_cli_bad_group_is_a_usage_error(rota_cli: Any) -> None:
    result = CliRunner().invoke(rota_cli, ["k8s", "tenant", "--group", "a:b", "--image", "img:1", "--", "true"])
    assert result.exit_code == 2 and "label value" in result.stderr and result.stdout == ""
