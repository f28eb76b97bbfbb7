"""The SPANK plugin on a real cluster: options validated at submit, ROTA_* env (and the job's token) in jobs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jwt
import pytest

from rota import auth
from rota.config import MAX_PRIORITY, MIN_PRIORITY
from rota_slurm.testing import SlurmCluster

pytestmark = pytest.mark.slurm

PRINT_ENV = f"{sys.executable} -c 'import json,os; print(json.dumps({{k: v for k, v in os.environ.items() " \
            "if k.startswith((\"ROTA_\", \"SLURM_JOB_ID\", \"CUDA_VISIBLE\", \"SLURM_JOB_GPUS\", " \
            "\"SLURM_STEP_GPUS\", \"SLURM_PROCID\"))}))'"


def _env_of(out: Path) -> dict[str, str]:
    return json.loads(out.read_text().strip().splitlines()[-1])


def _envs_of(out: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in out.read_text().splitlines() if line.startswith("{")]


def _labelled(stdout: str) -> dict[int, dict[str, str]]:
    """`srun --label` output of PRINT_ENV: task id -> env."""
    rows = (line.split(": ", 1) for line in stdout.splitlines() if ": {" in line)
    return {int(label): json.loads(env) for label, env in rows}


def _token_of(env: dict[str, str], auth_key: Path) -> auth.Principal:
    return auth.verify(auth.load_key(str(auth_key)), env["ROTA_TOKEN"])


def test_sbatch_sets_rota_env(slurm: SlurmCluster, orchestrator_address: str, auth_key: Path, outdir: Path) -> None:
    # ROTA_RANK/ROTA_WORLD_SIZE (and a token) from the submitting shell must not reach a one-task step
    job = slurm.sbatch("--timeslice=envg", "--timeslice-priority=7", "--gres=shard:1", "-w", "n1", "-t", "30",
                       "--export=ALL,ROTA_RANK=3,ROTA_WORLD_SIZE=5,ROTA_TOKEN=forged", "-o", str(outdir / "%j.out"),
                       "--wrap", PRINT_ENV)
    slurm.wait_jobs([job], timeout=60)
    env = _env_of(outdir / f"{job}.out")
    assert env["ROTA_GROUP"] == "envg"
    assert env["ROTA_TENANT"] == job == env["SLURM_JOB_ID"]
    assert env["ROTA_ORCHESTRATOR"] == orchestrator_address
    assert env["ROTA_PRIORITY"] == "7"
    # one process: its ranks are its own (torch.distributed under torchrun), not the job's task count
    assert "ROTA_RANK" not in env and "ROTA_WORLD_SIZE" not in env
    assert env["CUDA_VISIBLE_DEVICES"] in ("0", "1")
    claims = _token_of(env, auth_key)  # the plugin's token replaced the forged one: this job, this group
    assert (claims.group, claims.job, claims.admin) == ("envg", job, False)
    lifetime = jwt.decode(env["ROTA_TOKEN"], options={"verify_signature": False})
    assert 30 * 60 <= lifetime["exp"] - lifetime["iat"] <= 40 * 60 + 5  # the time limit (-t 30) plus 10 minutes


def test_job_without_timeslice_gets_no_rota_env(slurm: SlurmCluster, outdir: Path) -> None:
    job = slurm.sbatch("-o", str(outdir / "%j.out"), "--wrap", PRINT_ENV)
    slurm.wait_jobs([job], timeout=60)
    assert not any(k.startswith("ROTA_") for k in _env_of(outdir / f"{job}.out"))


def test_timeslice_without_a_gpu_request_is_warned_about_in_the_job_output(slurm: SlurmCluster,
                                                                            outdir: Path) -> None:
    bare = slurm.sbatch("--timeslice=nogpu", "-w", "n1", "-o", str(outdir / "bare.out"), "-e",
                        str(outdir / "bare.err"), "--wrap", PRINT_ENV)
    shard = slurm.sbatch("--timeslice=nogpu", "--gres=shard:1", "-w", "n1", "-o", str(outdir / "shard.out"), "-e",
                         str(outdir / "shard.err"), "--wrap", PRINT_ENV)
    slurm.wait_jobs([bare, shard], timeout=60)
    warning = "rota: warning: --timeslice=nogpu without a GPU request: Slurm gave this step no GPU"
    err = (outdir / "bare.err").read_text()
    assert warning in err and "--gres=shard:1" in err and err.count("rota: warning") == 1
    assert "CUDA_VISIBLE_DEVICES" not in _env_of(outdir / "bare.out")  # what the warning is about
    assert "rota: warning" not in (outdir / "shard.err").read_text()
    assert _env_of(outdir / "shard.out")["ROTA_GROUP"] == "nogpu"  # warned, not refused: it still runs


def test_srun_ranks_share_tenant(slurm: SlurmCluster) -> None:
    res = slurm.run("srun", "--timeslice=rankg", "-n", "3", "-w", "n1", "--label", sys.executable, "-c",
                    "import os; print(os.environ['ROTA_TENANT'], os.environ['ROTA_RANK'], "
                    "os.environ['ROTA_WORLD_SIZE'], os.environ['ROTA_GROUP'])", timeout=90)
    rows = sorted(line.split(":", 1)[1].split() for line in res.stdout.splitlines() if ":" in line)
    assert len(rows) == 3
    assert len({r[0] for r in rows}) == 1  # one tenant (the job id) for every rank
    assert [r[1] for r in rows] == ["0", "1", "2"]
    assert {r[2] for r in rows} == {"3"} and {r[3] for r in rows} == {"rankg"}


def test_group_per_node_placeholder(slurm: SlurmCluster, outdir: Path) -> None:
    jobs = {n: slurm.sbatch("--timeslice=node-%n", "-w", n, "-o", str(outdir / "%j.out"), "--wrap", PRINT_ENV)
            for n in ("n1", "n2")}
    slurm.wait_jobs(list(jobs.values()), timeout=60)
    assert {n: _env_of(outdir / f"{j}.out")["ROTA_GROUP"] for n, j in jobs.items()} == \
        {"n1": "node-n1", "n2": "node-n2"}


def _token_matches(env: dict[str, str], auth_key: Path) -> bool:
    """The step's token acts for exactly the group and job the plugin named in this env."""
    claims = _token_of(env, auth_key)
    return (claims.group, claims.job) == (env["ROTA_GROUP"], env["ROTA_TENANT"])


def test_group_per_gpu_set(slurm: SlurmCluster, auth_key: Path, outdir: Path) -> None:
    """`%g` names the GPUs a job's GRES sit on: one shard, two whole GPUs, one GPU per task."""
    shard = slurm.sbatch("--timeslice=gs-%n-%g", "--gres=shard:1", "-w", "n1", "-o", str(outdir / "shard.out"),
                         "--wrap", PRINT_ENV)
    # the batch script, then a two-task step on the same two GPUs
    pair = slurm.sbatch("--timeslice=gs-%n-%g", "--gres=gpu:2", "-n2", "-w", "n2", "-o", str(outdir / "pair.out"),
                        "--wrap", f"{PRINT_ENV}; srun -n2 {PRINT_ENV}")
    slurm.wait_jobs([shard, pair], timeout=90)
    (one,) = _envs_of(outdir / "shard.out")
    assert one["ROTA_GROUP"] == f"gs-n1-gpu{one['SLURM_JOB_GPUS']}"
    batch, *ranks = _envs_of(outdir / "pair.out")
    assert batch["ROTA_GROUP"] == "gs-n2-gpu0_1" and "ROTA_WORLD_SIZE" not in batch
    assert sorted((r["ROTA_GROUP"], r["ROTA_RANK"], r["ROTA_WORLD_SIZE"], r["ROTA_TENANT"]) for r in ranks) == \
        [("gs-n2-gpu0_1", "0", "2", pair), ("gs-n2-gpu0_1", "1", "2", pair)]
    # Slurm binds each task to one GPU; both ranks still get the step's group
    res = slurm.run("srun", "--timeslice=gs-%n-%g", "-n2", "--gpus-per-task=1", "-w", "n2", "--label", "bash", "-c",
                    PRINT_ENV, timeout=90)
    tasks = _labelled(res.stdout)
    assert sorted(t["CUDA_VISIBLE_DEVICES"] for t in tasks.values()) == ["0", "1"]
    assert {t["ROTA_GROUP"] for t in tasks.values()} == {"gs-n2-gpu0_1"}
    assert [tasks[r]["ROTA_RANK"] for r in (0, 1)] == ["0", "1"]
    # every step's token names the group its own GPUs gave it
    assert all(_token_matches(env, auth_key) for env in [one, batch, *ranks, *tasks.values()])


def test_placeholders_need_one_node_and_gpus(slurm: SlurmCluster, outdir: Path) -> None:
    res = slurm.run("srun", "--timeslice=mn-%n", "-N2", "-n2", "true", timeout=90, check=False)
    assert res.returncode != 0
    assert "rota: --timeslice=mn-%n names one node's group, but this step runs on 2 nodes" in res.stderr
    res = slurm.run("srun", "--timeslice=%n-%g", "-n1", "-w", "n1", "true", timeout=90, check=False)
    assert res.returncode != 0
    assert "uses %g, but the step has no GPUs on node 'n1'" in res.stderr
    # the batch script of a two-node job is one process on the first node: %n is fine there
    job = slurm.sbatch("--timeslice=mb-%n", "-N2", "-o", str(outdir / "%j.out"), "--wrap", PRINT_ENV)
    slurm.wait_jobs([job], timeout=60)
    assert _env_of(outdir / f"{job}.out")["ROTA_GROUP"] == "mb-n1"


@pytest.mark.parametrize(("args", "message"), [
    (["--timeslice="], "--timeslice= is empty"),
    (["--timeslice=bad/group"], "--timeslice=bad/group may only contain"),
    (["--timeslice=-lead"], "--timeslice=-lead must start with a letter or digit"),
    (["--timeslice=" + "x" * 129], "--timeslice=" + "x" * 129 + " is longer than 128"),
    (["--timeslice=g", "--timeslice-priority=high"], "--timeslice-priority=high is not an integer"),
    (["--timeslice=g", "--timeslice-priority="], "--timeslice-priority= is not an integer"),
    (["--timeslice=g", f"--timeslice-priority={MAX_PRIORITY + 1}"],  # what the orchestrator would refuse later
     f"--timeslice-priority={MAX_PRIORITY + 1} is not an integer between {MIN_PRIORITY} and {MAX_PRIORITY}"),
    (["--timeslice=g", "--timeslice-priority=5000"], "--timeslice-priority=5000 is not an integer between"),
    (["--timeslice=g", f"--timeslice-priority={MIN_PRIORITY - 1}"], f"--timeslice-priority={MIN_PRIORITY - 1} is not"),
])
def test_bad_values_fail_at_submit(slurm: SlurmCluster, args: list[str], message: str) -> None:
    before = slurm.run("squeue", "-h", "-o", "%i").stdout.split()
    res = slurm.run("sbatch", *args, "--wrap", "true", check=False)
    assert res.returncode != 0
    assert f"rota: {message}" in res.stderr
    assert slurm.run("squeue", "-h", "-o", "%i").stdout.split() == before  # nothing was queued


def test_help_lists_options(slurm: SlurmCluster) -> None:
    out = slurm.run("sbatch", "--help").stdout
    assert "--timeslice=GROUP" in out and "--timeslice-priority=N" in out
    assert f"an integer from {MIN_PRIORITY} to {MAX_PRIORITY}" in " ".join(out.split())


def test_the_priority_range_edges_are_accepted_and_run(slurm: SlurmCluster, outdir: Path) -> None:
    jobs = [slurm.sbatch("--timeslice=edges", f"--timeslice-priority={p}", "--gres=shard:1", "-w", "n1", "-o",
                         str(outdir / f"{i}.out"), "--wrap", PRINT_ENV) for i, p in enumerate((MIN_PRIORITY,
                                                                                                 MAX_PRIORITY))]
    slurm.wait_jobs(jobs, timeout=60)
    assert [_env_of(outdir / f"{i}.out")["ROTA_PRIORITY"] for i in range(2)] == [str(MIN_PRIORITY),
                                                                                   str(MAX_PRIORITY)]


NO_GPU = "rota: warning: --timeslice=atsubmit without a GPU request: Slurm will give the job no GPU"


def test_sbatch_itself_warns_about_a_job_without_a_gpu_request(slurm: SlurmCluster, tmp_path: Path) -> None:
    """The warning reaches the submitting terminal (sbatch's stderr), not only the job's output file; a GPU asked
    on the command line, in an SBATCH_ variable or in the script's #SBATCH lines silences it."""
    asks = tmp_path / "asks.sh"
    asks.write_text("#!/bin/sh\n#SBATCH --gres=shard:1\n#SBATCH -w n1\ntrue\n")
    bare = tmp_path / "bare.sh"
    bare.write_text("#!/bin/sh\n#SBATCH -w n1\ntrue\n")
    base = ("sbatch", "--parsable", "--timeslice=atsubmit", "-o", "/dev/null")
    warned = [slurm.run(*base, "-w", "n1", "--wrap", "true"), slurm.run(*base, str(bare))]
    quiet = [slurm.run(*base, "--gres=shard:1", "-w", "n1", "--wrap", "true"),
             slurm.run(*base, "--gres", "shard:1", "-w", "n1", "--wrap", "true"),
             slurm.run(*base, str(asks))]
    for res in warned:
        assert res.stderr.count(NO_GPU) == 1 and "--gres=shard:1" in res.stderr, res.stderr
        assert res.stdout.strip()  # warned, still submitted
    for res in quiet:
        assert "rota: warning" not in res.stderr, res.stderr
    env = slurm.run("env", "SBATCH_GRES=shard:1", *base, "-w", "n1", "--wrap", "true")
    assert "rota: warning" not in env.stderr
    plain = slurm.run("sbatch", "--parsable", "-o", "/dev/null", "-w", "n1", "--wrap", "true")  # no --timeslice
    assert "rota: warning" not in plain.stderr
    slurm.wait_jobs([r.stdout.strip().split(";")[0] for r in (*warned, *quiet, env, plain)], timeout=60)


@pytest.mark.parametrize("command", [["srun", "-N1"], ["salloc", "-N1"]])
def test_srun_and_salloc_validate_too(slurm: SlurmCluster, command: list[str]) -> None:
    res = slurm.run(*command, "--timeslice=no spaces", "true", check=False, timeout=60)
    assert res.returncode != 0
    assert "rota: --timeslice=no spaces may only contain" in res.stderr
    ok = slurm.run(*command, "--timeslice=fine", "--timeslice-priority=-3", "true", check=False, timeout=60)
    assert ok.returncode == 0, ok.stderr
