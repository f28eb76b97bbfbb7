"""`rota k8s tenant --gpus N`: the group's claim asks for N devices, a bad N is refused,
ranks come from torch.distributed in a multi-GPU pod (checked with a real torchrun and a
real orchestrator), and `--check-claim` compares with the claim FakeKubeApi serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from k8s_checks import pod_env, pod_specs, roundtrip

from rota.errors import InvalidArgument
from rota_k8s import GPUS_LABEL, TenantSpec, claim_name, resource_claim, tenant, validate_objects
from rota_k8s._claims import claim_gpus
from rota_k8s_controller.testing import FakeKubeApi

WORKER = Path(__file__).with_name("torchrun_worker.py")


def spec(**kw: Any) -> TenantSpec:
    base: dict[str, Any] = {"group_id": "grp0", "job_id": "ddp-1", "image": "reg.example/ddp:1",
                            "command": ("torchrun", "--nproc-per-node", "4", "train.py")}
    return TenantSpec(**{**base, **kw})


def env_of(pod_spec: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in pod_spec["containers"][0]["env"]}


def tenant_args(*extra: str) -> list[str]:
    return ["k8s", "tenant", "--group", "grp0", "--image", "img:1", "--job-id", "ddp-1", *extra, "--", "python",
            "train.py"]


@pytest.mark.parametrize("gpus", [1, 2, 8, 64])
def test_claim_asks_for_n_gpus_and_validates(gpus: int) -> None:
    claim, job = tenant(spec(gpus=gpus))
    (request,) = claim["spec"]["devices"]["requests"]
    assert request["exactly"] == {"deviceClassName": "gpu.nvidia.com", "allocationMode": "ExactCount", "count": gpus}
    assert claim["metadata"]["name"] == claim_name("grp0")  # one claim per group, whatever N
    assert claim["metadata"]["labels"][GPUS_LABEL] == job["metadata"]["labels"][GPUS_LABEL] == str(gpus)
    assert pod_specs([job])[0][1]["labels"][GPUS_LABEL] == str(gpus)
    validate_objects([claim, job])  # strict, every Kubernetes release from 1.34
    assert roundtrip(claim) == claim
    assert claim_gpus(claim) == gpus


def test_schema_check_sees_the_count() -> None:
    """The offline validation is not blind to the request: a wrongly typed count is refused."""
    claim = resource_claim("grp0", "default", gpus=2)
    claim["spec"]["devices"]["requests"][0]["exactly"]["count"] = "two"
    with pytest.raises(Exception, match="count"):
        validate_objects([claim], ["1.34"])


def test_tenants_with_other_counts_render_visibly_different_claims() -> None:
    one, two = tenant(spec(gpus=1))[0], tenant(spec(gpus=2, job_id="ddp-2"))[0]
    assert one["metadata"]["name"] == two["metadata"]["name"]  # same claim: the API server refuses the 2nd spec
    assert one["spec"] != two["spec"]
    assert (one["metadata"]["labels"][GPUS_LABEL], two["metadata"]["labels"][GPUS_LABEL]) == ("1", "2")


@pytest.mark.parametrize(("kw", "words"), [
    ({"gpus": 0}, "gpus 0 is out of range: a group's claim asks for 1 to 64 GPUs of one node; give --gpus N"),
    ({"gpus": -2}, "gpus -2 is out of range"),
    ({"gpus": 65}, "gpus 65 is out of range"),
    ({"gpus": True}, "gpus True is out of range"),
    ({"gpus": 2.0}, "gpus 2.0 is out of range"),
    ({"gpus": 2, "world_size": 2}, r"2 ranks \(pods\) with 2 GPUs.*run one pod \(--ranks 1\).*--nproc-per-node 2"),
    ({"gpus": 2, "env": {"ROTA_RANK": "0"}}, "would be the same for every process of the pod"),
])
def test_bad_gpu_specs_are_refused(kw: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidArgument, match=words):
        tenant(spec(**kw))


@pytest.mark.parametrize(("value", "words"), [
    ("0", "gpus 0 is out of range"),
    ("65", "give --gpus N with N from 1 to 64"),
    ("two", "'two' is not a valid integer"),
])
def test_cli_refuses_bad_gpus(rota_cli: Any, value: str, words: str) -> None:
    result = CliRunner().invoke(rota_cli, tenant_args("--gpus", value))
    assert result.exit_code == 2 and words in result.stderr and result.stdout == ""


def test_cli_refuses_several_pods_with_several_gpus(rota_cli: Any) -> None:
    result = CliRunner().invoke(rota_cli, tenant_args("--gpus", "4", "--ranks", "4"))
    assert result.exit_code == 2 and "run one pod (--ranks 1)" in result.stderr and result.stdout == ""


@pytest.mark.parametrize("kind", ["job", "pod"])
def test_multi_gpu_pod_leaves_ranks_to_torch_distributed(rota_cli: Any, kind: str) -> None:
    result = CliRunner().invoke(rota_cli, tenant_args("--gpus", "4", "--kind", kind))
    assert result.exit_code == 0, result.output
    claim, workload = yaml.safe_load_all(result.stdout)
    assert claim["spec"]["devices"]["requests"][0]["exactly"]["count"] == 4
    (_, meta, ps), = pod_specs([workload])
    env = env_of(ps)
    assert "ROTA_RANK" not in env and "ROTA_WORLD_SIZE" not in env
    seen = pod_env({**meta, "namespace": "default"}, ps, secrets={("rota-token-ddp-1", "token"): "T"})
    assert (seen["ROTA_GROUP"], seen["ROTA_TENANT"]) == ("default.grp0", "default.ddp-1")
    assert ps["resourceClaims"] == [{"name": "gpu", "resourceClaimName": "rota-group-grp0"}]
    if kind == "job":
        assert workload["spec"]["completions"] == workload["spec"]["parallelism"] == 1


def test_one_gpu_jobs_keep_one_rank_per_pod() -> None:
    (_, _, ps), = pod_specs([tenant(spec(world_size=3, gpus=1))[1]])
    env = env_of(ps)
    assert env["ROTA_WORLD_SIZE"] == "3"
    assert env["ROTA_RANK"] == {"fieldRef": {
        "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}}


def test_torchrun_in_a_multi_gpu_pod_is_one_job_of_n_ranks(orchestrator: tuple[str, Any], tmp_path: Path) -> None:
    """The pod's env as the kubelet gives it, a real torchrun with 2 local ranks (CPU, gloo), a real orchestrator
    (served without credentials here, so the pod is rendered without its token)."""
    endpoint, engine = orchestrator
    (_, meta, ps), = pod_specs([tenant(spec(gpus=2, orchestrator=endpoint, job_id="ddp-7", token=False))[1]])
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env.update(pod_env({**meta, "namespace": "default", "name": "ddp-7-0"}, ps))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(WORKER), str(tmp_path)], env=env, capture_output=True, text=True, timeout=240)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [(r["rank"], r["world"], r["torch_rank"], r["local_rank"]) for r in ranks] == [(0, 2, 0, 0), (1, 2, 1, 1)]
    assert {(r["tenant"], r["group"]) for r in ranks} == {("default.ddp-7", "default.grp0")}
    assert ranks[0]["tokens"] == ranks[1]["tokens"] and [n for _, n in ranks[0]["tokens"]] == [2, 2]
    assert ranks[0]["rota_env"] == []
    rec = engine.groups["default.grp0"].tenants["default.ddp-7"]
    assert (rec.world_size, rec.turns) == (2, 2)  # one job of two ranks, queued once per turn


# ------------------------------------------------------------------ --check-claim against FakeKubeApi


@pytest.fixture
def kubeconfig(fake_api: FakeKubeApi, tmp_path: Path) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {"server": fake_api.url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
    return str(path)


def test_check_claim_passes_for_a_new_group_and_the_same_count(rota_cli: Any, fake_api: FakeKubeApi,
                                                               kubeconfig: str) -> None:
    first = CliRunner().invoke(rota_cli, tenant_args("--gpus", "2", "--check-claim", "--kubeconfig", kubeconfig))
    assert first.exit_code == 0, first.output
    assert "does not exist yet: this tenant creates it with 2 GPU(s)" in first.stderr
    claim, _ = yaml.safe_load_all(first.stdout)
    fake_api.put_claim(claim)  # what kubectl apply made of it
    again = CliRunner().invoke(rota_cli, tenant_args("--gpus", "2", "--check-claim", "--kubeconfig", kubeconfig))
    assert again.exit_code == 0, again.output
    assert "asks for 2 GPU(s), as this tenant does" in again.stderr
    assert any(path.endswith("/resourceclaims/rota-group-grp0") for path, _ in fake_api.requests)


def test_check_claim_refuses_another_count(rota_cli: Any, fake_api: FakeKubeApi, kubeconfig: str) -> None:
    fake_api.put_claim(resource_claim("grp0", "default", gpus=1))
    result = CliRunner().invoke(rota_cli, tenant_args("--gpus", "4", "--check-claim", "--kubeconfig", kubeconfig))
    assert result.exit_code == 2 and result.stdout == ""
    assert ("--gpus 4, but ResourceClaim default/rota-group-grp0 of group 'grp0' asks for 1 GPU(s)" in result.stderr
            and "use --gpus 1, or another --group" in result.stderr)
    # without --check-claim nothing is read and the tenant is printed (the API server refuses the claim later)
    before = len(fake_api.requests)
    assert CliRunner().invoke(rota_cli, tenant_args("--gpus", "4")).exit_code == 0
    assert len(fake_api.requests) == before


def test_check_claim_with_a_named_claim(rota_cli: Any, fake_api: FakeKubeApi, kubeconfig: str) -> None:
    missing = CliRunner().invoke(rota_cli, tenant_args("--claim", "team-gpu", "--check-claim",
                                                       "--kubeconfig", kubeconfig))
    assert missing.exit_code == 2 and "ResourceClaim default/team-gpu (--claim) does not exist" in missing.stderr
    team = resource_claim("grp0", "default", name="team-gpu", gpus=1)
    team["spec"]["devices"]["requests"][0]["exactly"] = {"deviceClassName": "gpu.nvidia.com", "allocationMode": "All"}
    fake_api.put_claim(team)
    open_count = CliRunner().invoke(rota_cli, tenant_args("--claim", "team-gpu", "--gpus", "2", "--check-claim",
                                                          "--kubeconfig", kubeconfig))
    assert open_count.exit_code == 0, open_count.output
    assert "does not ask for a fixed number of gpu.nvidia.com devices" in open_count.stderr


def test_check_claim_without_an_api_server_is_an_error(rota_cli: Any, kubeconfig: str, fake_api: FakeKubeApi) -> None:
    fake_api.close()
    result = CliRunner().invoke(rota_cli, tenant_args("--check-claim", "--kubeconfig", kubeconfig))
    assert result.exit_code == 1 and result.stdout == ""
    assert "--check-claim: cannot read ResourceClaim default/rota-group-grp0" in result.stderr


def test_claim_gpus_reads_exact_requests_only() -> None:
    def claim(*requests: dict[str, Any]) -> dict[str, Any]:
        return {"spec": {"devices": {"requests": list(requests)}}}

    gpu = {"deviceClassName": "gpu.nvidia.com"}
    assert claim_gpus(claim({"name": "a", "exactly": gpu})) == 1  # count defaults to 1
    assert claim_gpus(claim({"name": "a", "exactly": {**gpu, "count": 3}},
                            {"name": "nic", "exactly": {"deviceClassName": "nic.example.com", "count": 2}})) == 3
    assert claim_gpus(claim({"name": "a", "exactly": {**gpu, "allocationMode": "All"}})) is None
    assert claim_gpus(claim({"name": "a", "firstAvailable": [{"name": "x", **gpu}]})) is None
    assert claim_gpus(claim()) is None
