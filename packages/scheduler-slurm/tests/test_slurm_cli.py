"""`rota slurm submit/status/check/epilog` against the real cluster and orchestrator."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from rota.testing import cli_with_plugins
from rota_slurm._orchestrator import group_status
from rota_slurm.testing import SlurmCluster

pytestmark = pytest.mark.slurm

HOLDER = Path(__file__).with_name("holder.py")


@pytest.fixture
def rota_slurm_cli(slurm: SlurmCluster, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setenv("SLURM_CONF", str(slurm.conf))
    return cli_with_plugins()


def _until(pred, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)


def test_submit_and_status(slurm: SlurmCluster, orchestrator_address: str, outdir: Path, rota_slurm_cli) -> None:  # type: ignore[no-untyped-def]
    runner = CliRunner()
    res = runner.invoke(rota_slurm_cli, ["slurm", "submit", "--group", "cli-g", "--tenants", "2", "--node", "n2",
                                         "--", "-o", str(outdir / "%j.out"), "--wrap",
                                         f"{sys.executable} {HOLDER} rota {outdir / 'held-$SLURM_JOB_ID'}"])
    assert res.exit_code == 0, res.output
    jobs = res.output.split()
    assert len(jobs) == 2
    try:
        _until(lambda: (g := group_status(orchestrator_address, "cli-g")) and g[0].holder in jobs
               and len(g[0].queue) == 1, "one tenant holding, one waiting")
        st = runner.invoke(rota_slurm_cli, ["slurm", "status", "--orchestrator", orchestrator_address,
                                            "--group", "cli-g", "--json"])
        assert st.exit_code == 0, st.output
        rows = {r["job_id"]: r for r in json.loads(st.output)["jobs"]}
        assert set(rows) == set(jobs)
        assert sorted(r["turn"] for r in rows.values()) == ["holding", "waiting"]
        assert {r["slurm_state"] for r in rows.values()} == {"RUNNING"}  # both placed on n2's shards at once
        assert {r["nodes"] for r in rows.values()} == {"n2"}
        table = runner.invoke(rota_slurm_cli, ["slurm", "status", "--orchestrator", orchestrator_address])
        assert "holding" in table.output and "waiting" in table.output
        # without --orchestrator: the one in the cluster's plugstack.conf, found through $SLURM_CONF
        found = runner.invoke(rota_slurm_cli, ["slurm", "status", "--group", "cli-g"],
                              env={"SLURM_CONF": str(slurm.conf), "ROTA_ORCHESTRATOR": None})
        assert found.exit_code == 0 and "holding" in found.output, found.output
    finally:
        slurm.run("scancel", *jobs)
        slurm.wait_jobs(jobs, timeout=60)
    _until(lambda: not group_status(orchestrator_address, "cli-g")[0].holder, "group cli-g freed", timeout=30)


def test_status_without_an_orchestrator_anywhere_says_where_to_put_it(rota_slurm_cli, tmp_path) -> None:  # type: ignore[no-untyped-def]
    conf = tmp_path / "slurm.conf"
    conf.write_text(f"PlugStackConfig={tmp_path / 'plugstack.conf'}\n")
    res = CliRunner().invoke(rota_slurm_cli, ["slurm", "status"], env={"SLURM_CONF": str(conf),
                                                                       "ROTA_ORCHESTRATOR": None})
    assert res.exit_code == 2 and "no orchestrator= on rota's line" in res.output and "plugstack.conf" in res.output


def test_submit_rejects_bad_group(rota_slurm_cli) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(rota_slurm_cli, ["slurm", "submit", "--group", "bad group", "--", "x.sh"])
    assert res.exit_code == 2 and "malformed" in res.output


def test_whole_gpu_job_on_shared_gpu_is_detected_and_submit_refuses(slurm: SlurmCluster, outdir: Path,
                                                                    rota_slurm_cli) -> None:  # type: ignore[no-untyped-def]
    """Slurm 22.05 places `--gres=gpu:1` on a GPU whose shards are in use; rota notices."""
    runner = CliRunner()
    shard = slurm.sbatch("--gres=shard:1", "-w", "n1", "-o", "/dev/null", "--wrap", "sleep 120")
    jobs = [shard]
    try:
        _until(lambda: slurm.job_state(shard) == "RUNNING", "shard job running")
        jobs += [slurm.sbatch("--gres=gpu:1", "-w", "n1", "-o", "/dev/null", "--wrap", "sleep 120") for _ in range(2)]
        _until(lambda: all(slurm.job_state(j) in ("RUNNING", "PENDING") for j in jobs[1:]) and
               any(slurm.job_state(j) == "RUNNING" for j in jobs[1:]), "a whole-GPU job running")
        time.sleep(1)  # give the second whole-GPU job its chance to be scheduled too
        running = [j for j in jobs[1:] if slurm.job_state(j) == "RUNNING"]
        chk = runner.invoke(rota_slurm_cli, ["slurm", "check"])
        if len(running) == 2:  # both GPUs given whole while a shard job runs: one must be shared
            assert chk.exit_code == 1 and f"shard job {shard}" in chk.output, chk.output
            sub = runner.invoke(rota_slurm_cli, ["slurm", "submit", "--group", "guard-g", "--node", "n1", "--",
                                                 "--wrap", "true"])
            assert sub.exit_code == 1 and "refusing to submit" in sub.output
        else:  # Slurm kept the shard GPU to itself: nothing to report
            assert chk.exit_code == 0, chk.output
    finally:
        slurm.run("scancel", *jobs)
        slurm.wait_jobs(jobs, timeout=60)


def test_epilog_without_group_is_a_noop(rota_slurm_cli) -> None:  # type: ignore[no-untyped-def]
    res = CliRunner().invoke(rota_slurm_cli, ["slurm", "epilog"], env={"SPANK_ROTA_GROUP": ""})
    assert res.exit_code == 0 and res.output == ""


def test_epilog_evicts_at_the_plugstack_orchestrator(orchestrator_address: str, rota_slurm_cli) -> None:  # type: ignore[no-untyped-def]
    """As a site Epilog= script: job and group from the env, orchestrator and key from plugstack.conf."""
    from rota import auth
    from rota.wire import timeslice_orchestrator_pb2 as v1a
    from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc

    with auth.channel(orchestrator_address) as ch:  # the admin token of this process
        v1a_grpc.TimeSliceOrchestratorServiceStub(ch).Acquire(v1a.AcquireRequest(job_id="900001", group_id="ep-g"),
                                                               timeout=30)
    res = CliRunner().invoke(rota_slurm_cli, ["slurm", "epilog"], env={
        "SLURM_JOB_ID": "900001", "SPANK_ROTA_GROUP": "ep-g", "ROTA_TOKEN": "",
        "SPANK_ROTA_ORCHESTRATOR": "127.0.0.1:9", "ROTA_ORCHESTRATOR": "127.0.0.1:9"})  # ignored
    assert res.exit_code == 0, res.output
    assert "holder=True" in res.output
    assert group_status(orchestrator_address, "ep-g")[0].holder == ""
