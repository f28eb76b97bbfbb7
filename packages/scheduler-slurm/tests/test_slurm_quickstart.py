"""`rota slurm quickstart`: a one-node cluster on a machine without GPUs, where --timeslice jobs take turns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from rota_slurm.testing import missing_binaries

pytestmark = pytest.mark.slurm
ROTA = os.path.join(os.path.dirname(sys.executable), "rota")


@pytest.mark.skipif(bool(missing_binaries()) or os.geteuid() != 0, reason="needs root and Slurm's packages")
def test_quickstart_runs_timeslice_jobs_and_stops_cleanly(orchestrator_address: str, auth_key: Path,
                                                          tmp_path: Path) -> None:
    folder = tmp_path / "qs"
    proc = subprocess.Popen([ROTA, "slurm", "quickstart", str(folder), "--orchestrator", orchestrator_address,
                             "--auth-key", str(auth_key), "--gpus", "1", "--tenants-per-gpu", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        conf, hints = "", []
        assert proc.stdout is not None
        for line in proc.stdout:  # the printed instructions name the cluster's slurm.conf
            if line.strip().startswith("export SLURM_CONF="):
                conf = line.strip().split("=", 1)[1]
            if line.startswith("  ") and line.strip():
                hints.append(line.strip())
            if line.startswith("Ctrl-C"):
                break
        assert conf == str(folder.resolve() / "etc" / "slurm.conf"), proc.stderr.read() if proc.stderr else ""
        # the hints work as printed, in a shell without ROTA_* settings: submit, then `rota slurm status` as admin
        shell = {k: v for k, v in os.environ.items() if not k.startswith(("ROTA_", "SLURM_"))}
        script = "set -e\n" + "\n".join(hints) + "\nwhile squeue -h | grep -q .; do sleep 0.3; done\n"
        ran = subprocess.run(["bash", "-c", script], env=shell, capture_output=True, text=True, timeout=180,
                             cwd=tmp_path)
        assert ran.returncode == 0, ran.stderr
        submitted = ran.stdout.split("Submitted batch job ", 1)[1].split()[0]
        assert "JOBID" in ran.stdout and f"\n{submitted} " in ran.stdout, ran.stdout  # rota slurm status answered
        assert (tmp_path / f"slurm-{submitted}.out").read_text().split() == ["1"]  # the hint's job got its turn
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
        env["SLURM_CONF"] = conf
        script = f"{sys.executable} -c 'import os, rota; g = rota.connect(); g.acquire(); " \
                 "print(os.environ[\"ROTA_GROUP\"], os.environ[\"CUDA_VISIBLE_DEVICES\"], flush=True); g.release()'"
        jobs = [subprocess.run(["sbatch", "--parsable", "--timeslice=qs", "--gres=shard:1", "-o",
                                str(tmp_path / f"job{i}.out"), "--wrap", script], env=env, capture_output=True,
                               text=True, check=True, timeout=60).stdout.strip() for i in range(2)]
        subprocess.run(["bash", "-c", f"while squeue -h -j {','.join(jobs)} | grep -q .; do sleep 0.3; done"],
                       env=env, check=True, timeout=120)
        assert [(tmp_path / f"job{i}.out").read_text().split() for i in range(2)] == [["qs", "0"], ["qs", "0"]]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "cluster stopped" in err
    assert subprocess.run(["pgrep", "-f", str(folder)], capture_output=True).returncode == 1  # its daemons are gone


def test_quickstart_without_root_or_packages_says_what_to_do(tmp_path: Path) -> None:
    if os.geteuid() == 0 and not missing_binaries():
        pytest.skip("this machine can run the cluster: the messages are for one that cannot")
    out = subprocess.run([ROTA, "slurm", "quickstart", str(tmp_path), "--orchestrator", "127.0.0.1:1"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and ("apt-get install munge" in out.stderr or "run it with sudo" in out.stderr)
