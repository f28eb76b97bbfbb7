"""Fixtures: one real Slurm cluster (two nodes on this host) and one rota orchestrator.

Both are session-scoped: the daemons take a couple of seconds to start and every test
uses its own group ids. The orchestrator runs as ``rota orchestrator serve`` in a
subprocess with a long TTL (60 s), so a test that sees a group freed within its
timeout knows the SPANK epilog (Evict) did it, not the TTL. It checks credentials
(``--auth-key``): the cluster's plugin gives each job its token, and this test process
holds an admin token in ``ROTA_TOKEN``, as an operator's shell would.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from rota import auth
from rota.testing import free_port
from rota_slurm._orchestrator import group_status
from rota_slurm.testing import SlurmCluster, missing_binaries

ROTA = str(Path(sys.executable).parent / "rota")


@pytest.fixture(scope="session")
def auth_key() -> Iterator[Path]:
    """The orchestrator's auth key (mode 0600), as an admin would keep it under /etc/rota."""
    keydir = Path(tempfile.mkdtemp(prefix="rota-key-"))
    auth.generate_key(str(keydir / "auth.key"))
    yield keydir / "auth.key"
    shutil.rmtree(keydir, ignore_errors=True)


@pytest.fixture(scope="session")
def admin_token(auth_key: Path) -> str:
    return auth.issue(auth.load_key(str(auth_key)), admin=True)


@pytest.fixture(autouse=True)
def _operator_shell(admin_token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Slurm test runs as an operator's shell would, with an admin token in ``ROTA_TOKEN``; the tests
    of other packages (run later in the same session) never see it."""
    monkeypatch.setenv("ROTA_TOKEN", admin_token)


@pytest.fixture(scope="session")
def orchestrator_address(auth_key: Path, admin_token: str) -> Iterator[str]:
    """The address of this session's ``rota orchestrator serve`` process (with ``--auth-key``; the fixtures' own
    ``orchestrator`` is embedded); its log is at ``orchestrator.log`` in the tmp dir."""
    endpoint = f"127.0.0.1:{free_port()}"
    logdir = Path(tempfile.mkdtemp(prefix="rota-orch-"))
    admin = pytest.MonkeyPatch()  # only while it starts: the tests get the token from _operator_shell
    admin.setenv("ROTA_TOKEN", admin_token)
    with open(logdir / "orchestrator.log", "wb") as out:
        proc = subprocess.Popen([ROTA, "--log-level", "info", "orchestrator", "serve", "--listen", endpoint,
                                 "--ttl", "60", "--auth-key", str(auth_key)], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                group_status(endpoint, timeout=1)
                break
            except Exception:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("orchestrator did not start:\n"
                                       + (logdir / "orchestrator.log").read_text()) from None
                time.sleep(0.1)
        admin.undo()
        _LOGS["orchestrator"] = logdir / "orchestrator.log"
        yield endpoint
    finally:
        admin.undo()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
        shutil.rmtree(logdir, ignore_errors=True)


_LOGS: dict[str, Path] = {}


@pytest.fixture
def orchestrator_log(orchestrator_address: str) -> Path:
    """The log file of the session's orchestrator (served at --log-level info; evictions are warnings)."""
    return _LOGS["orchestrator"]


@pytest.fixture(scope="session")
def slurm(orchestrator_address: str, auth_key: Path) -> Iterator[SlurmCluster]:
    """A running two-node Slurm cluster whose SPANK plugin points jobs at ``orchestrator`` with their tokens."""
    missing = missing_binaries()
    if missing:
        pytest.skip(f"Slurm test cluster needs {', '.join(missing)} (scripts/services.sh install)")
    if os.geteuid() != 0:
        pytest.skip("Slurm test cluster needs root")
    root = Path(tempfile.mkdtemp(prefix="rota-slurm-"))
    cluster = SlurmCluster(root, nodes=("n1", "n2"), gpus_per_node=2, shards_per_gpu=4, cpus_per_node=4,
                           orchestrator=orchestrator_address, auth_key=str(auth_key))
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def outdir(slurm: SlurmCluster, request: pytest.FixtureRequest) -> Path:
    """A directory for this test's job output files."""
    d = slurm.root / "out" / request.node.name
    d.mkdir(parents=True, exist_ok=True)
    return d
