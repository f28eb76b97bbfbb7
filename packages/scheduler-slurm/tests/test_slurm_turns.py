"""Three CPU training tenants submitted with `sbatch --timeslice=G --gres=shard:1` share
one fake GPU through the orchestrator: all finish, their turns never overlap, and their
losses equal those of dedicated runs."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rota_slurm._orchestrator import group_status
from rota_slurm.testing import SlurmCluster

pytestmark = pytest.mark.slurm

TENANT = Path(__file__).with_name("tenant_train.py")
SEEDS = (1, 2, 3)


def _dedicated(seed: int, out: Path) -> list[float]:
    subprocess.run([sys.executable, str(TENANT), str(seed), str(out), "--dedicated"], check=True, timeout=120)
    return json.loads(out.read_text())["losses"]


def _submit_tenants(slurm: SlurmCluster, group: str, node: str, outdir: Path) -> dict[int, str]:
    return {seed: slurm.sbatch(f"--timeslice={group}", "--gres=shard:1", "-w", node, "-o",
                               str(outdir / f"slurm-{seed}.out"), "--wrap",
                               f"{sys.executable} {TENANT} {seed} {outdir / f'tenant-{seed}.json'}")
            for seed in SEEDS}


def _check_group(slurm: SlurmCluster, orchestrator_address: str, group: str, jobs: dict[int, str],
                 outdir: Path) -> list:
    for seed, job in jobs.items():
        assert slurm.job_state(job) == "COMPLETED", (outdir / f"slurm-{seed}.out").read_text()
    results = {seed: json.loads((outdir / f"tenant-{seed}.json").read_text()) for seed in SEEDS}
    for seed, r in results.items():
        assert r["env"]["ROTA_GROUP"] == group and r["env"]["ROTA_TENANT"] == jobs[seed]
        assert r["losses"] == _dedicated(seed, outdir / f"dedicated-{seed}.json")  # bit-identical
    turns = sorted((t for r in results.values() for t in r["turns"]), key=lambda t: t[1])
    assert len(turns) == 3 * len(results[SEEDS[0]]["losses"])
    for a, b in itertools.pairwise(turns):
        assert a[2] <= b[1], f"turns overlap: {a} and {b}"
        assert a[0] < b[0], "fencing tokens must grow with every turn"
    (g,) = group_status(orchestrator_address, group)
    assert {t.job_id: t.turns for t in g.tenants} == {j: len(results[s]["turns"]) for s, j in jobs.items()}
    assert g.holder == "" and list(g.queue) == []  # every job left: nobody holds, nobody waits
    assert g.switches >= 2
    return turns


def test_three_tenants_take_turns_on_one_gpu(slurm: SlurmCluster, orchestrator_address: str, outdir: Path) -> None:
    jobs = _submit_tenants(slurm, "turns-g0", "n1", outdir)
    slurm.wait_jobs(list(jobs.values()), timeout=240)
    _check_group(slurm, orchestrator_address, "turns-g0", jobs, outdir)
    # all three were placed on the same node and GPU (shards), at the same time
    starts = [json.loads((outdir / f"tenant-{s}.json").read_text())["turns"][0][1] for s in SEEDS]
    ends = [json.loads((outdir / f"tenant-{s}.json").read_text())["turns"][-1][2] for s in SEEDS]
    assert max(starts) < min(ends), "tenants did not run concurrently (they were serialised by Slurm)"


def test_two_nodes_one_group_each(slurm: SlurmCluster, orchestrator_address: str, outdir: Path) -> None:
    d1, d2 = outdir / "n1", outdir / "n2"
    d1.mkdir(exist_ok=True)
    d2.mkdir(exist_ok=True)
    jobs1 = _submit_tenants(slurm, "pernode-%n", "n1", d1)
    jobs2 = _submit_tenants(slurm, "pernode-%n", "n2", d2)
    slurm.wait_jobs([*jobs1.values(), *jobs2.values()], timeout=300)
    t1 = _check_group(slurm, orchestrator_address, "pernode-n1", jobs1, d1)
    t2 = _check_group(slurm, orchestrator_address, "pernode-n2", jobs2, d2)
    # the groups are independent: some turn on n1 overlapped some turn on n2
    assert any(a[1] < b[2] and b[1] < a[2] for a in t1 for b in t2), "the two nodes' groups never ran together"
