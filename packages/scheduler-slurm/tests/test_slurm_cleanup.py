"""No held group outlives its Slurm job: scancel, or a job that ends holding its turn.

The orchestrator runs with a 60 s TTL, longer than these tests wait, so the group can
only have been freed by the session ending (rota client) or by the SPANK plugin's job
epilog calling Evict (v1alpha1 client, which has no session).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from rota_slurm._orchestrator import group_status
from rota_slurm.testing import SlurmCluster

pytestmark = pytest.mark.slurm

HOLDER = Path(__file__).with_name("holder.py")
TENANT = Path(__file__).with_name("tenant_train.py")


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _holder(orchestrator_address: str, group: str) -> str:
    groups = group_status(orchestrator_address, group)
    return groups[0].holder if groups else ""


def _has_held(orchestrator_address: str, group: str, job: str) -> bool:
    """``job`` holds ``group`` now, or held it already: a job that exits holding is evicted by its epilog at once,
    and on a loaded CI machine that window passed between two polls (the wait then timed out)."""
    groups = group_status(orchestrator_address, group)
    return bool(groups) and (groups[0].holder == job or any(t.job_id == job and t.turns >= 1
                                                             for t in groups[0].tenants))


def _run_case(slurm: SlurmCluster, orchestrator_address: str, outdir: Path, group: str, kind: str, *,
              cancel: bool) -> str:
    marker = outdir / "held"
    holder = slurm.sbatch(f"--timeslice={group}", "--gres=shard:1", "-w", "n1", "-o", str(outdir / "holder.out"),
                          "--wrap", f"{sys.executable} {HOLDER} {kind} {marker}" + ("" if cancel else " --exit"))
    try:
        _wait_for(lambda: marker.exists() and _has_held(orchestrator_address, group, holder),
                  f"job {holder} to hold {group}")
    except TimeoutError as e:
        out = outdir / "holder.out"
        raise TimeoutError(f"{e}: job state {slurm.job_state(holder)!r}, marker {marker.exists()}, group "
                           f"{group_status(orchestrator_address, group)}, holder.out: "
                           f"{out.read_text()[-2000:] if out.exists() else '(none)'}") from e
    waiter = slurm.sbatch(f"--timeslice={group}", "--gres=shard:1", "-w", "n1", "-o", str(outdir / "waiter.out"),
                          "--wrap", f"{sys.executable} {TENANT} 5 {outdir / 'waiter.json'}")
    if cancel:
        _wait_for(lambda: waiter in group_status(orchestrator_address, group)[0].queue, f"job {waiter} to queue")
        slurm.run("scancel", holder)
    slurm.wait_jobs([holder, waiter], timeout=180)
    assert slurm.job_state(waiter) == "COMPLETED", (outdir / "waiter.out").read_text()
    assert slurm.job_state(holder) == ("CANCELLED" if cancel else "COMPLETED")
    (g,) = group_status(orchestrator_address, group)
    assert g.holder == "" and list(g.queue) == []
    turns = {t.job_id: t.turns for t in g.tenants}
    assert turns[holder] == 1 and turns[waiter] == 6
    return holder


def test_scancel_of_rota_holder_frees_group(slurm: SlurmCluster, orchestrator_address: str, outdir: Path) -> None:
    _run_case(slurm, orchestrator_address, outdir, "cancel-rota", "rota", cancel=True)


def test_scancel_of_v1alpha1_holder_is_evicted_by_epilog(slurm: SlurmCluster, orchestrator_address: str,
                                                          orchestrator_log: Path, outdir: Path) -> None:
    holder = _run_case(slurm, orchestrator_address, outdir, "cancel-v1a", "v1alpha1", cancel=True)
    log = orchestrator_log.read_text()
    assert f"evicted job {holder} from group cancel-v1a: slurm job {holder} ended" in log


def test_job_ending_while_holding_is_evicted_by_epilog(slurm: SlurmCluster, orchestrator_address: str,
                                                        orchestrator_log: Path, outdir: Path) -> None:
    holder = _run_case(slurm, orchestrator_address, outdir, "exit-v1a", "v1alpha1", cancel=False)
    assert f"evicted job {holder} from group exit-v1a: slurm job {holder} ended" in orchestrator_log.read_text()


def test_epilog_finds_the_gpu_set_group(slurm: SlurmCluster, orchestrator_address: str, orchestrator_log: Path,
                                        outdir: Path) -> None:
    """With --timeslice=%n-%g the epilog gets the pattern and evicts the job from the group its GPUs named."""
    marker = outdir / "held"
    holder = slurm.sbatch("--timeslice=epg-%n-%g", "--gres=shard:1", "-w", "n1", "-o", str(outdir / "holder.out"),
                          "--wrap", f"{sys.executable} {HOLDER} v1alpha1 {marker}")
    _wait_for(lambda: marker.exists(), f"job {holder} to hold its group")
    (group,) = [g.group_id for g in group_status(orchestrator_address) if g.holder == holder]
    assert group in ("epg-n1-gpu0", "epg-n1-gpu1")
    slurm.run("scancel", holder)
    slurm.wait_jobs([holder], timeout=120)
    _wait_for(lambda: _holder(orchestrator_address, group) == "", f"group {group} freed")
    assert f"evicted job {holder} from group {group}: slurm job {holder} ended" in orchestrator_log.read_text()
