"""Pure helpers: GRES config lines, placement hook, plugstack editing, GRES parsing, guard."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from rota import TurnRequest
from rota._plugins import new_plugin_manager
from rota.cli.main import cli
from rota_slurm import GresLayout, PlugstackLine, conflicts, gres_conf, write_plugstack
from rota_slurm._slurm import SlurmJob, _job_from_json, parse_gres_detail
from rota_slurm.plugin import rota_cli


@pytest.fixture(scope="module")
def rota_cli_with_slurm():  # type: ignore[no-untyped-def]
    if "slurm" not in cli.commands:
        rota_cli(cli)
    return cli


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


def test_write_plugstack_keeps_other_lines_and_replaces_ours(tmp_path: Path) -> None:
    conf = tmp_path / "plugstack.conf"
    conf.write_text("optional /usr/lib/other.so x=1\n")
    write_plugstack(conf, PlugstackLine(Path("/opt/rota_spank.so"), orchestrator="o:1"))
    write_plugstack(conf, PlugstackLine(Path("/opt/rota_spank.so"), orchestrator="o:2", rota="/bin/rota"))
    lines = conf.read_text().splitlines()
    assert lines[0] == "optional /usr/lib/other.so x=1"
    assert lines[-1] == "required /opt/rota_spank.so orchestrator=o:2 rota=/bin/rota"
    assert sum("rota_spank.so" in line for line in lines) == 1


def test_install_spank_builds_and_writes(tmp_path: Path, rota_cli_with_slurm) -> None:  # type: ignore[no-untyped-def]
    if not Path("/usr/include/slurm/spank.h").exists():
        pytest.skip("slurm/spank.h missing (Debian libslurm-dev)")
    conf = tmp_path / "plugstack.conf"
    res = CliRunner().invoke(rota_cli_with_slurm, ["slurm", "install-spank", "--dest", str(tmp_path / "lib"),
                                                   "--plugstack", str(conf), "--orchestrator", "10.0.0.1:50051"])
    assert res.exit_code == 0, res.output
    so = tmp_path / "lib" / "rota_spank.so"
    assert so.read_bytes()[:4] == b"\x7fELF"
    assert f"required {so} orchestrator=10.0.0.1:50051 rota=" in conf.read_text()
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
