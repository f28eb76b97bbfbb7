"""Pure helpers: GRES config lines, placement hook, plugstack editing, GRES parsing, guard."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from rota import TurnRequest, auth
from rota.errors import ConfigError
from rota.testing import cli_with_plugins, new_plugin_manager
from rota_slurm import GresLayout, PlugstackLine, conflicts, gres_conf, write_plugstack
from rota_slurm._slurm import SlurmJob, _job_from_json, parse_gres_detail
from rota_slurm._spank import plugstack_path, read_plugstack


@pytest.fixture(scope="module")
def rota_cli_with_slurm():  # type: ignore[no-untyped-def]
    return cli_with_plugins()


def test_gres_conf_spreads_shards_over_gpus() -> None:
    text = gres_conf(GresLayout(gpus=2, shards_per_gpu=3))
    assert text.splitlines() == ["AutoDetect=off", "Name=gpu File=/dev/nvidia[0-1]",
                                 "Name=shard Count=3 File=/dev/nvidia0", "Name=shard Count=3 File=/dev/nvidia1"]


def test_conf_command_prints_gres_and_slurm_lines(rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "conf", "--gpus", "8", "--tenants-per-gpu", "4",
                                                   "--node", "gpu01"])
    assert res.exit_code == 0, res.output
    assert "GresTypes=gpu,shard" in res.output
    assert "NodeName=gpu01 Gres=gpu:8,shard:32" in res.output
    assert "Name=gpu File=/dev/nvidia[0-7]" in res.output
    assert res.output.count("Name=shard Count=4") == 8


def test_conf_rejects_zero(rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "conf", "--gpus", "0", "--tenants-per-gpu", "4"])
    assert res.exit_code == 2 and "--gpus" in res.output


def test_place_hook_answers_for_slurm_only() -> None:
    pm = new_plugin_manager()
    req = TurnRequest(job_id="j1", group_id="g0", priority=3)
    placement = pm.hook.rota_place(request=req, scheduler="slurm")
    assert placement is not None and placement.scheduler == "slurm"
    assert placement.details["gres"] == "shard:1"
    assert placement.details["sbatch_args"] == "--timeslice=g0 --gres=shard:1 --timeslice-priority=3"
    assert pm.hook.rota_place(request=req, scheduler="k8s-only-for-this-test") is None


def test_plugin_is_listed(rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(rota_cli_with_slurm, ["plugins"])
    assert res.exit_code == 0 and "rota-scheduler-slurm" in res.output


def test_write_plugstack_keeps_other_lines_and_replaces_ours(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    conf = tmp_path / "plugstack.conf"
    conf.write_text("optional /usr/lib/other.so x=1\n")
    write_plugstack(conf, PlugstackLine(Path("/opt/rota_spank.so"), orchestrator="o:1"))
    write_plugstack(conf, PlugstackLine(Path("/opt/rota_spank.so"), orchestrator="o:2", rota="/bin/rota"))
    lines = conf.read_text().splitlines()
    assert lines[0] == "optional /usr/lib/other.so x=1"
    assert lines[-1] == "required /opt/rota_spank.so orchestrator=o:2 rota=/bin/rota"
    assert sum("rota_spank.so" in line for line in lines) == 1
    write_plugstack(conf, PlugstackLine(Path("/opt/rota_spank.so"), orchestrator="o:3", python="/py",
                                        auth_key="/etc/rota/auth.key"))
    slurm_conf = tmp_path / "slurm.conf"
    slurm_conf.write_text(f"ClusterName=c\nPlugStackConfig={conf}  # rota's line is here\n")
    monkeypatch.setenv("SLURM_CONF", str(slurm_conf))
    assert plugstack_path() == conf
    assert read_plugstack(conf) == {"orchestrator": "o:3", "python": "/py", "auth_key": "/etc/rota/auth.key"}
    with pytest.raises(ConfigError, match="contains white space"):
        PlugstackLine(Path("/opt/rota_spank.so"), auth_key="/etc/my keys/k").render()


def test_install_spank_builds_and_writes(tmp_path: Path, rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    if not Path("/usr/include/slurm/spank.h").exists():
        pytest.skip("slurm/spank.h missing (Debian libslurm-dev)")
    conf, key = tmp_path / "plugstack.conf", tmp_path / "auth.key"
    auth.generate_key(str(key))
    res = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "install-spank", "--dest", str(tmp_path / "lib"),
                                                   "--plugstack", str(conf), "--orchestrator", "10.0.0.1:50051",
                                                   "--auth-key", str(key)])
    assert res.exit_code == 0, res.output
    so = tmp_path / "lib" / "rota_spank.so"
    assert so.read_bytes()[:4] == b"\x7fELF"
    assert f"required {so} orchestrator=10.0.0.1:50051 rota=" in conf.read_text()
    assert read_plugstack(conf)["auth_key"] == str(key) and read_plugstack(conf)["python"] == sys.executable
    key.chmod(0o644)  # every job's token could be forged by whoever reads it
    res = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "install-spank", "--dest", str(tmp_path / "lib"),
                                                   "--auth-key", str(key)])
    assert res.exit_code == 1 and "is readable by others (mode 644)" in res.output
    printed = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "install-spank", "--dest", str(tmp_path / "lib")])
    assert printed.output.startswith(f"required {so}")


def test_install_spank_rejects_bad_orchestrator(tmp_path: Path, rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "install-spank", "--dest", str(tmp_path),
                                                   "--orchestrator", "no port here"])
    assert res.exit_code == 2


def test_gres_detail_parsing() -> None:
    gpu, shard = parse_gres_detail(["n1", "n2"], ["gpu:2(IDX:0-1)", "shard:2(CNT:2/IDX:1),gpu:1(IDX:3)"])
    assert gpu == {"n1": {0, 1}, "n2": {3}} and shard == {"n2": {1}}
    job = _job_from_json({"job_id": 7, "name": "w", "job_state": "RUNNING", "nodes": "n1",
                          "gres_detail": ["shard:1(IDX:0)"]})
    assert job.shard_idx == {"n1": {0}} and job.gpu_idx == {}


def test_conflict_guard() -> None:
    shard = SlurmJob("1", "t", "RUNNING", "n1", shard_idx={"n1": {0}})
    whole_same = SlurmJob("2", "w", "RUNNING", "n1", gpu_idx={"n1": {0}})
    whole_other = SlurmJob("3", "w", "RUNNING", "n1", gpu_idx={"n1": {1}})
    other_node = SlurmJob("4", "w", "RUNNING", "n2", gpu_idx={"n2": {0}})
    found = conflicts([shard, whole_same, whole_other, other_node])
    assert [(c.node, c.gpu, c.whole_gpu_job, c.shard_job) for c in found] == [("n1", 0, "2", "1")]


def test_submit_accepts_placeholders(rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "submit", "--group", "%n-%g", "--dry-run", "--", "x.sh"])
    assert res.exit_code == 0, res.output
    assert res.output.strip() == "sbatch --parsable --timeslice=%n-%g --gres=shard:1 x.sh"
    bad = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "submit", "--group", "g-%x", "--dry-run", "--", "x.sh"])
    assert bad.exit_code == 2 and "'g-%x' is malformed" in bad.output and "%g (the job's GPUs" in bad.output


def test_epilog_with_gpu_sets_evicts_the_job_from_its_nodes_matching_groups(
        orchestrator_address: str, rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    from rota import auth
    from rota.wire import timeslice_orchestrator_pb2 as v1a
    from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc
    from rota_slurm._orchestrator import group_status

    held = {"epg2-n1-gpu0": "900002", "epg2-n1-gpu0_1": "900002", "epg2-n2-gpu0": "900002",
            "epg2-n1-gpu1": "900003", "epg2x-n1-gpu0": "900002"}
    epilog = ["slurm", "epilog", "--orchestrator", orchestrator_address]  # the token: this process's admin ROTA_TOKEN
    with auth.channel(orchestrator_address) as ch:  # v1alpha1: no session, only Evict frees these
        stub = v1a_grpc.TimeSliceOrchestratorServiceStub(ch)
        for group, job in held.items():
            stub.Acquire(v1a.AcquireRequest(job_id=job, group_id=group), timeout=30)
    res = CliRunner().invoke(rota_cli_with_slurm, epilog, env={
        "SLURM_JOB_ID": "900002", "SPANK_ROTA_GROUP": "epg2-%n-%g",
        "SLURMD_NODENAME": "n1"})
    assert res.exit_code == 0, res.output
    assert sorted(res.output.splitlines()) == ["job 900002 left group epg2-n1-gpu0 (holder=True, queued=False)",
                                               "job 900002 left group epg2-n1-gpu0_1 (holder=True, queued=False)"]
    holders = {g.group_id: g.holder for g in group_status(orchestrator_address) if g.group_id in held}
    assert holders == {"epg2-n1-gpu0": "", "epg2-n1-gpu0_1": "", "epg2-n2-gpu0": "900002", "epg2-n1-gpu1": "900003",
                       "epg2x-n1-gpu0": "900002"}
    again = CliRunner().invoke(rota_cli_with_slurm, epilog, env={
        "SLURM_JOB_ID": "900002", "SPANK_ROTA_GROUP": "epg2-%n-%g",
        "SLURMD_NODENAME": "n1"})
    assert again.exit_code == 0 and again.output == "job 900002 was in no group matching epg2-n1-%g\n"
    no_node = CliRunner().invoke(rota_cli_with_slurm, epilog, env={
        "SLURM_JOB_ID": "900002", "SPANK_ROTA_GROUP": "epg2-%n-%g",
        "SLURMD_NODENAME": ""})
    assert no_node.exit_code == 1 and "SLURMD_NODENAME is unset" in no_node.output
