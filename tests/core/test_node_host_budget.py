"""The node-wide host budget across real processes: the ledger refuses, spills, and forgets the dead."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from rota.errors import ConfigError
from rota.tensors import HostBudgetExceeded, HostPool, node_host_bytes

MB = 1 << 20

HOLDER = textwrap.dedent("""
    import sys, time
    from rota.tensors import HostPool
    pool = HostPool(pin=False, chunk_bytes=1 << 20)
    pool.reserve(int(sys.argv[1]))
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.fixture()
def ledger(tmp_path, monkeypatch):
    path = tmp_path / "ledger"
    monkeypatch.setenv("ROTA_NODE_LEDGER_DIR", str(path))
    monkeypatch.setenv("ROTA_NODE_HOST_BUDGET_BYTES", str(100 * MB))
    monkeypatch.delenv("ROTA_HOST_BUDGET_BYTES", raising=False)
    monkeypatch.delenv("ROTA_SPILL_DIR", raising=False)
    return path


def _holder(nbytes: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(nbytes)], stdout=subprocess.PIPE, text=True,
                            env=os.environ.copy())
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def test_other_processes_count_against_the_node_budget_until_they_die(ledger, tmp_path):
    holder = _holder(60 * MB)
    try:
        assert node_host_bytes() == {holder.pid: 60 * MB}
        with pytest.raises(HostBudgetExceeded, match=r"node budget .*ROTA_NODE_HOST_BUDGET_BYTES.* 0\.063 GB"):
            HostPool(pin=False, spill_dir="").reserve(60 * MB)
        spill = tmp_path / "spill"
        spill.mkdir()
        pool = HostPool(pin=False, spill_dir=str(spill), chunk_bytes=8 * MB)
        pool.reserve(60 * MB)  # what does not fit beside the holder goes to files
        assert 0 < pool.spilled_bytes < 60 * MB and pool.capacity == 60 * MB
        assert node_host_bytes()[os.getpid()] == pool.capacity - pool.spilled_bytes
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert holder.pid not in node_host_bytes()  # a SIGKILLed process leaves nothing counted
    HostPool(pin=False, spill_dir="").reserve(60 * MB)  # now there is room


def test_two_processes_racing_for_the_last_room_do_not_both_get_it(ledger):
    procs = [subprocess.Popen([sys.executable, "-c", HOLDER, str(60 * MB)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=os.environ.copy()) for _ in range(2)]
    try:
        lines = [p.stdout.readline().strip() for p in procs]  # type: ignore[union-attr]
        assert sorted(lines) == ["", "ready"]  # exactly one got its 60 MB; the other was refused
        loser = procs[lines.index("")]
        assert loser.wait() != 0 and "HostBudgetExceeded" in loser.stderr.read()  # type: ignore[union-attr]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_bad_node_budget_and_ledger_dir_name_the_value(monkeypatch, tmp_path):
    monkeypatch.setenv("ROTA_NODE_HOST_BUDGET_BYTES", "lots")
    with pytest.raises(ConfigError, match="ROTA_NODE_HOST_BUDGET_BYTES='lots'"):
        HostPool(pin=False)
    monkeypatch.setenv("ROTA_NODE_HOST_BUDGET_BYTES", "-1")
    with pytest.raises(ConfigError, match="negative"):
        HostPool(pin=False)
    monkeypatch.setenv("ROTA_NODE_HOST_BUDGET_BYTES", str(MB))
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("ROTA_NODE_LEDGER_DIR", str(blocker / "sub"))
    with pytest.raises(ConfigError, match=r"ROTA_NODE_LEDGER_DIR=.*cannot be created"):
        HostPool(pin=False).reserve(MB)
