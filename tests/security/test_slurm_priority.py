"""Issue 30, item 2 on Slurm: a job's token carries the priority it may use, bounded by plugstack.conf.

The attacker submits ``--timeslice-priority=1000`` to jump every queue. The orchestrator
(``--auth-key``) refuses a priority above the token's; the SPANK plugin issues each step's
token with the job's own priority only when plugstack.conf's ``max_priority=`` allows it,
and otherwise gives no token (slurmd's log says why), so the job cannot act at the
orchestrator. Runs a real one-node Slurm cluster (root and the Slurm daemons needed).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import jwt
import pytest

from rota import auth
from rota_slurm.testing import missing_binaries, slurm_cluster

PRINT_TOKEN = 'echo "TOKEN=$ROTA_TOKEN"'


def test_a_jobs_token_allows_only_the_priority_the_node_allows(tmp_path):
    missing = missing_binaries()
    if missing or os.geteuid() != 0:
        pytest.skip(f"needs root and Slurm ({', '.join(missing) or 'not root'})")
    key = tmp_path / "auth.key"
    auth.generate_key(str(key))
    root = Path(tempfile.mkdtemp(prefix="rota-slurm-prio-"))
    try:
        with slurm_cluster(root, nodes=("n1",), orchestrator="", auth_key=str(key), max_priority=5) as cluster:
            jobs = {}
            for prio in (0, 5, 1000):
                out = root / f"p{prio}.out"
                args = ["--timeslice=g0", *([f"--timeslice-priority={prio}"] if prio else []), "-o", str(out),
                        "--wrap", PRINT_TOKEN]
                jobs[prio] = (cluster.sbatch(*args), out)
            cluster.wait_jobs([j for j, _ in jobs.values()], timeout=120)
            claims = {}
            for prio, (_, out) in jobs.items():
                text = out.read_text() if out.exists() else ""
                token = next((line[6:] for line in text.splitlines() if line.startswith("TOKEN=")), "")
                claims[prio] = jwt.decode(token, options={"verify_signature": False}) if token else None
            assert claims[0] is not None and "rota_max_priority" not in claims[0]  # priority 0 and below only
            assert claims[5] is not None and claims[5]["rota_max_priority"] == 5
            token = next(line[6:] for line in jobs[5][1].read_text().splitlines() if line.startswith("TOKEN="))
            assert auth.verify(auth.load_key(str(key)), token).max_priority == 5
            assert claims[1000] is None  # no token: it cannot act at the orchestrator at all
            assert "above max_priority=5 of plugstack.conf" in cluster.log_text("slurmd-n1")
    finally:
        shutil.rmtree(root, ignore_errors=True)

