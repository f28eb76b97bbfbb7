"""Row 26: the Slurm job epilog evicts as root, so it must not go where the job's user says.

The epilog runs with the job-control environment, which the submitting user shapes: a
user's own sbatch can load any SPANK plugin (``SLURM_CONF`` pointing at their own
plugstack.conf) and set ``SPANK_ROTA_ORCHESTRATOR`` to an endpoint of theirs. Before,
with no ``orchestrator=`` in the node's plugstack.conf, ``rota slurm epilog`` took that
endpoint and sent root's Evict (now with an admin token) there. The "attacker's
orchestrator" here is a plain TCP listener that records every connection.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rota import auth
from rota_slurm.testing import missing_binaries, slurm_cluster

ROTA = str(Path(sys.executable).parent / "rota")

# The user's own SPANK plugin: at submit time it names their endpoint in the job-control environment.
EVIL_PLUGIN = r"""
#include <slurm/spank.h>
SPANK_PLUGIN(evil, 1);
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
    if (spank_context() == S_CTX_ALLOCATOR && ac > 0)
        spank_job_control_setenv(sp, "ROTA_ORCHESTRATOR", av[0], 1);
    return 0;
}
"""


class Listener:
    """The attacker's endpoint: accepts on loopback and counts connections (a gRPC call would be one)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@pytest.fixture
def attacker_endpoint() -> Iterator[Listener]:
    listener = Listener()
    yield listener
    listener.close()


@pytest.fixture
def key(tmp_path: Path) -> Path:
    """An auth key as an admin keeps it: the epilog would make an admin token from it."""
    auth.generate_key(str(tmp_path / "auth.key"))
    return tmp_path / "auth.key"


def test_row26_epilog_never_takes_the_orchestrator_from_its_environment(attacker_endpoint, key, tmp_path):
    """`rota slurm epilog` as a site Epilog= script: plugstack.conf without orchestrator=, a hostile env."""
    plugstack = tmp_path / "plugstack.conf"
    plugstack.write_text(f"required /usr/local/lib/rota/rota_spank.so auth_key={key}\n")
    (tmp_path / "slurm.conf").write_text(f"ClusterName=c\nPlugStackConfig={plugstack}\n")
    env = {"PATH": "/usr/bin:/bin", "SLURM_CONF": str(tmp_path / "slurm.conf"), "SLURM_JOB_ID": "4242",
           "SPANK_ROTA_GROUP": "g0", "SPANK_ROTA_ORCHESTRATOR": attacker_endpoint.endpoint,
           "SLURM_SPANK_ROTA_ORCHESTRATOR": attacker_endpoint.endpoint, "ROTA_ORCHESTRATOR": attacker_endpoint.endpoint}
    res = subprocess.run([ROTA, "slurm", "epilog", "--timeout", "3"], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr  # an Epilog= script that fails would drain the node
    assert f"job 4242: not evicted: no orchestrator= in {plugstack}" in res.stderr
    assert attacker_endpoint.connections == 0


def test_row26_slurm_job_epilog_without_orchestrator_evicts_nothing(attacker_endpoint, key, tmp_path):
    """The real path: slurmd runs the plugin's job epilog for a job whose submitter injected an endpoint."""
    missing = missing_binaries()
    if missing or os.geteuid() != 0:
        pytest.skip(f"needs root and Slurm ({', '.join(missing) or 'not root'})")
    root = Path(tempfile.mkdtemp(prefix="rota-slurm-sec-"))
    try:
        with slurm_cluster(root, nodes=("n1",), orchestrator="", auth_key=str(key)) as cluster:
            # the submitting user's own configuration: rota's plugin, and theirs naming their endpoint
            evil_so = root / "evil.so"
            (root / "evil.c").write_text(EVIL_PLUGIN)
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(evil_so), str(root / "evil.c")], check=True,
                           timeout=120)
            own = root / "user"
            own.mkdir()
            (own / "plugstack.conf").write_text((root / "etc" / "plugstack.conf").read_text()
                                                + f"required {evil_so} {attacker_endpoint.endpoint}\n")
            (own / "slurm.conf").write_text("\n".join(
                f"PlugStackConfig={own / 'plugstack.conf'}" if line.startswith("PlugStackConfig=") else line
                for line in cluster.conf.read_text().splitlines()) + "\n")
            out = root / "job.out"
            res = subprocess.run(["sbatch", "--parsable", "--timeslice=g0", "-o", str(out), "--wrap", "env"],
                                 env={**cluster.env, "SLURM_CONF": str(own / "slurm.conf")}, capture_output=True,
                                 text=True, timeout=60, check=True)
            job = res.stdout.strip().split(";")[0]
            cluster.wait_jobs([job], timeout=120)
            # the injection reached the job-control environment the epilog runs with
            assert f"SLURM_SPANK_ROTA_ORCHESTRATOR={attacker_endpoint.endpoint}" in out.read_text()
            reason = f"rota: job {job}: no orchestrator= in plugstack.conf, so its epilog evicts nothing"
            deadline = time.monotonic() + 60
            while reason not in cluster.log_text("slurmd-n1") and time.monotonic() < deadline:
                time.sleep(0.2)
            assert reason in cluster.log_text("slurmd-n1")
            assert cluster.job_state(job) == "COMPLETED"
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert attacker_endpoint.connections == 0  # root's Evict, and its admin token, never went there
