"""The node-wide host budget across real processes: the ledger refuses, spills, and forgets the dead;
a stuck lock is named, unsafe directories are refused, other uids are read again."""

from __future__ import annotations

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from rota.errors import ConfigError
from rota_torch import HostBudgetExceeded, HostPool, _ledger, host_bytes_in_use, node_host_bytes

MB = 1 << 20
NOBODY = 65534

HOLDER = textwrap.dedent("""
    import sys, time
    from rota_torch import HostPool
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
    gc.collect()
    earlier = host_bytes_in_use()[0]  # pools this test process still holds from earlier tests
    holder = _holder(60 * MB)
    try:
        assert {pid: n for pid, n in node_host_bytes().items() if pid != os.getpid()} == {holder.pid: 60 * MB}
        with pytest.raises(HostBudgetExceeded, match=r"node budget .*ROTA_NODE_HOST_BUDGET_BYTES.* 0\.063 GB"):
            HostPool(pin=False, spill_dir="").reserve(60 * MB)
        spill = tmp_path / "spill"
        spill.mkdir()
        pool = HostPool(pin=False, spill_dir=str(spill), chunk_bytes=8 * MB)
        pool.reserve(60 * MB)  # what does not fit beside the holder goes to files
        assert 0 < pool.spilled_bytes < 60 * MB and pool.capacity == 60 * MB
        assert node_host_bytes()[os.getpid()] == earlier + pool.capacity - pool.spilled_bytes
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


def test_a_stuck_lock_of_this_user_fails_in_time_naming_its_holder(ledger, monkeypatch):
    HostPool(pin=False, spill_dir="").reserve(MB)  # creates this uid's directory and lock
    lock = ledger / str(os.geteuid()) / "lock"
    stuck = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, time
        f = open({str(lock)!r}, "r+")
        fcntl.flock(f, fcntl.LOCK_EX)
        print("locked", flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert stuck.stdout is not None and stuck.stdout.readline().strip() == "locked"
        monkeypatch.setattr(_ledger, "LOCK_TIMEOUT_S", 0.3)
        with pytest.raises(_ledger.LedgerBusy, match=rf"{lock} has been held by pid {stuck.pid} for more than 0.3 s"):
            HostPool(pin=False, spill_dir="").reserve(MB)
    finally:
        stuck.kill()
        stuck.wait()
    HostPool(pin=False, spill_dir="").reserve(MB)  # the lock died with its holder


def test_unsafe_ledger_directories_are_refused(ledger, tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    monkeypatch.setenv("ROTA_NODE_LEDGER_DIR", str(tmp_path / "link"))
    with pytest.raises(ConfigError, match="is a symbolic link or not a directory"):
        node_host_bytes()
    real.chmod(0o777)
    monkeypatch.setenv("ROTA_NODE_LEDGER_DIR", str(real))
    with pytest.raises(ConfigError, match=r"writable by others without the sticky bit \(mode 777\)"):
        node_host_bytes()
    if os.geteuid() != 0:
        return
    os.chown(real, NOBODY, NOBODY)
    with pytest.raises(ConfigError, match=rf"is owned by uid {NOBODY}, not root or you"):
        node_host_bytes()
    real.chmod(0o1777)
    os.chown(real, 0, 0)
    squatted = real / "0"
    squatted.mkdir()
    os.chown(squatted, NOBODY, NOBODY)  # another user made this uid's directory first: one of its own is used
    pool = HostPool(pin=False, spill_dir="")
    pool.reserve(MB)
    assert node_host_bytes()[os.getpid()] == pool.capacity
    assert list(squatted.iterdir()) == []  # nothing was written into it
    (own,) = [p for p in real.iterdir() if p.name.startswith("0.")]
    assert own.stat().st_uid == 0 and (own / str(os.getpid())).exists()


def test_another_uid_growing_meanwhile_shrinks_this_claim(ledger, monkeypatch):
    """Other uids do not take this uid's lock: a claim is re-checked once it is visible to them.

    The other uid's growth is made to land between this process's first read and its
    record (a hook on ``record``: the race, forced); its entry is real, for a live
    process of uid 65534.
    """
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run a process as another uid")
    gc.collect()
    earlier = host_bytes_in_use()[0]  # pools this test process still holds from earlier tests
    other = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable,
                              "-c", "import time; held = b'x' * (60 << 20); time.sleep(60)"])  # really holds 60 MB
    try:
        deadline = time.monotonic() + 10  # setpriv runs as root for a moment before it becomes that uid
        while (os.stat(f"/proc/{other.pid}").st_uid != NOBODY or _ledger._held_bytes(other.pid) < 55 * MB) \
                and time.monotonic() < deadline:
            time.sleep(0.01)
        node_host_bytes()  # creates the root
        their_dir = ledger / str(NOBODY)
        their_dir.mkdir()
        os.chown(their_dir, NOBODY, NOBODY)
        real_record = _ledger.NodeLedger.record

        def record_after_the_other_uid_grew(self, nbytes):
            entry = their_dir / str(other.pid)
            if not entry.exists():
                entry.write_text(f"{_ledger._start_time(other.pid)} {50 * MB}\n")
                os.chown(entry, NOBODY, NOBODY)
            real_record(self, nbytes)

        monkeypatch.setattr(_ledger.NodeLedger, "record", record_after_the_other_uid_grew)
        with pytest.raises(HostBudgetExceeded, match=r"other rota processes on this node hold 0\.052 GB"):
            HostPool(pin=False, spill_dir="").reserve(60 * MB)
        assert node_host_bytes() == {other.pid: 50 * MB, os.getpid(): earlier}  # the claim was withdrawn
    finally:
        other.kill()
        other.wait()
