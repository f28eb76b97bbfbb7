"""Rows 25 and 27: another local user against the node host ledger and the spill files.

The victim is root (this test process and a root holder it starts); the attacker is a
second uid run through ``setpriv`` (fixture ``as_attacker``). Each attack is the one
that worked before: a lock held forever, forged entries, planted links, a directory the
attacker controls. Each test shows the attack fails and that the victim's state (its
ledger entries, the files it owns, its parked bytes) is what it would have been alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator

import pytest
import torch

from rota.errors import ConfigError
from rota_torch import HostBudgetExceeded, HostPool, TensorParker, node_host_bytes

MB = 1 << 20

# The attacker's code runs with these names defined; it forks a child that keeps what it holds (flocks, a racing
# loop) alive after the attacker's command returns, prints a JSON report, and the test kills the child by pid.
DETACH = textwrap.dedent("""
    import json, os, time
    def detach(work):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            os.setsid()
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            os.write(w, b"x"); os.close(w)
            work()
            os._exit(0)
        os.close(w); os.read(r, 1)
        return pid
    def attempt(what, fn):
        try:
            fn()
            report[what] = "done"
        except OSError as exc:
            report[what] = type(exc).__name__
    report = {}
""")

HOLDER = textwrap.dedent("""
    import sys, time
    from rota_torch import HostPool
    HostPool(pin=False, chunk_bytes=1 << 20).reserve(int(sys.argv[1]))
    print("ready", flush=True)
    time.sleep(600)
""")


@pytest.fixture
def shared_dir() -> Iterator[str]:
    """A root-owned directory in /tmp that every user may enter (mode set by the test)."""
    path = tempfile.mkdtemp(prefix="rota-sec-", dir="/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kill_later() -> Iterator[list[int]]:
    """Pids of the attacker's detached children, killed (by pid) when the test ends."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _attack(as_attacker, code: str, **names: object) -> dict:
    """Run ``code`` (after DETACH) as the attacker with ``names`` bound; its JSON report."""
    header = "".join(f"{k} = {v!r}\n" for k, v in names.items())
    res = as_attacker(DETACH + header + textwrap.dedent(code) + "\nprint(json.dumps(report))\n")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _snapshot(path: str) -> tuple[bytes, int, int]:
    st = os.lstat(path)
    with open(path, "rb") as f:
        return f.read(), st.st_mode, st.st_uid


ROW25_ATTACK = """
    import fcntl, stat
    me = os.getuid()
    victim_dir = os.path.join(root, "0")
    # 1. block the victim: its own lock, the old shared lock file, the root itself
    attempt("open victim lock", lambda: os.open(os.path.join(victim_dir, "lock"), os.O_RDONLY))
    held = [os.open(root, os.O_RDONLY), os.open(os.path.join(root, "lock"), os.O_RDWR | os.O_CREAT, 0o666)]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_EX)
    # 2. write or redirect in the victim's directory
    attempt("forge in victim dir", lambda: open(os.path.join(victim_dir, "4242"), "w"))
    attempt("plant victim tmp link", lambda: os.symlink(target, os.path.join(victim_dir, f"{victim}.tmp")))
    # 3. the old layout's tmp file, now a link to a root-owned file
    attempt("plant old tmp link", lambda: os.symlink(target, os.path.join(root, f"{victim}.tmp")))
    child = detach(lambda: time.sleep(300))  # keeps the flocks; a live process of the attacker's uid
    with open(f"/proc/{child}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    with open(f"/proc/{victim}/stat") as f:
        victim_start = f.read().rsplit(")", 1)[1].split()[19]
    # 4. forged entries in its own directory, and one posing as another uid's directory
    mine = os.path.join(root, str(me))
    os.makedirs(mine, exist_ok=True)
    os.chmod(mine, 0o777)
    entries = {str(child): f"{start} {10**15}\\n", str(victim): f"{victim_start} 999\\n",
               "17": f"{start} -{10**15}\\n", "18": "x" * 100}
    for name, text in entries.items():
        with open(os.path.join(mine, name), "w") as f:
            f.write(text)
    os.mkfifo(os.path.join(mine, "1"))
    os.symlink(target, os.path.join(mine, "2"))
    os.makedirs(os.path.join(root, "4242"))
    with open(os.path.join(root, "4242", str(child)), "w") as f:
        f.write(f"{start} {50 << 20}\\n")
    report["child"] = child
"""


def test_row25_node_ledger_other_uid_cannot_block_forge_or_redirect(as_attacker, shared_dir, kill_later, tmp_path,
                                                                     monkeypatch, caplog):
    os.chmod(shared_dir, 0o1777)  # the node's ledger root as an admin (or a root rota process) makes it
    monkeypatch.setenv("ROTA_NODE_LEDGER_DIR", shared_dir)
    monkeypatch.setenv("ROTA_NODE_HOST_BUDGET_BYTES", str(100 * MB))
    monkeypatch.delenv("ROTA_HOST_BUDGET_BYTES", raising=False)
    monkeypatch.delenv("ROTA_SPILL_DIR", raising=False)
    target = tmp_path / "root-owned"
    target.write_text("precious\n")
    env = {k: v for k, v in os.environ.items() if k != "ROTA_SPILL_DIR"}
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(60 * MB)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        entry = os.path.join(shared_dir, "0", str(holder.pid))
        before = _snapshot(entry), _snapshot(str(target))
        report = _attack(as_attacker, ROW25_ATTACK, root=shared_dir, victim=holder.pid, target=str(target))
        kill_later.append(report["child"])
        assert report == {"open victim lock": "PermissionError", "forge in victim dir": "PermissionError",
                          "plant victim tmp link": "PermissionError", "plant old tmp link": "done",
                          "child": report["child"]}

        caplog.set_level(logging.WARNING, logger="rota_torch._ledger")
        assert node_host_bytes() == {holder.pid: 60 * MB}  # no forged entry counts, positive or negative
        t0 = time.monotonic()
        with pytest.raises(HostBudgetExceeded, match=r"other rota processes on this node hold 0\.063 GB"):
            HostPool(pin=False, spill_dir="").reserve(60 * MB)
        pool = HostPool(pin=False, spill_dir="")
        pool.reserve(30 * MB)  # room the forged 10**15 would have taken away
        assert time.monotonic() - t0 < 5  # the attacker's flocks block nothing
        assert node_host_bytes() == {holder.pid: 60 * MB, os.getpid(): pool.capacity}
        assert (_snapshot(entry), _snapshot(str(target))) == before
        mine = os.path.join(shared_dir, "0", str(os.getpid()))
        assert stat.S_ISREG(os.lstat(mine).st_mode) and os.lstat(mine).st_uid == 0
        logged = caplog.text
        for why in ("more than this node's memory", "belongs to uid 0", "malformed", "not a regular file",
                    "cannot be opened", "directory owned by uid"):
            assert why in logged, why
    finally:
        holder.kill()
        holder.wait()


RACER = """
    import stat
    def race():
        # replace every file the victim shows in the directory by a link to its own precious file
        while True:
            for name in os.listdir(spill):
                try:
                    st = os.lstat(os.path.join(spill, name))
                    if st.st_uid != os.getuid():
                        with open(os.path.join(spill, "seen"), "a") as f:
                            f.write(name + "\\n")
                        os.rename(os.path.join(spill, name), os.path.join(spill, name + ".moved"))
                        os.symlink(target, os.path.join(spill, name))
                except OSError:
                    pass
    if own:
        os.mkdir(spill, 0o777)
        os.chmod(spill, 0o777)
    attempt("link", lambda: os.symlink(spill, link))
    report["child"] = detach(race)
"""


def _spill(spill_dir: str) -> tuple[HostPool, torch.Tensor]:
    """Park 1 MiB through a pool that must spill all of it (budget 1 KiB); returns the pool and what was parked."""
    pool = HostPool(pin=False, budget_bytes=1024, spill_dir=spill_dir, chunk_bytes=1 << 18)
    parker = TensorParker("cpu", pool=pool, verify="full")
    w = torch.randn(1 << 18)
    want = w.clone()
    parker.add("weights", [w])
    parker.park()
    parker.restore()
    assert torch.equal(w, want)
    return pool, want


def test_row27_spill_files_are_used_through_their_descriptor_only(as_attacker, shared_dir, kill_later, tmp_path):
    target = tmp_path / "root-owned"
    target.write_text("precious\n")
    before = _snapshot(str(target))

    # a directory the attacker owns, with its racer running: refused before anything is written
    theirs, link = os.path.join(shared_dir, "theirs"), os.path.join(shared_dir, "link")
    os.chmod(shared_dir, 0o1777)
    report = _attack(as_attacker, RACER, spill=theirs, link=link, target=str(target), own=True)
    kill_later.append(report["child"])
    assert report["link"] == "done"
    with pytest.raises(ConfigError, match=rf"spill_dir='{theirs}' is owned by uid \d+, who could swap the files"):
        HostPool(pin=False, budget_bytes=1024, spill_dir=theirs)
    with pytest.raises(ConfigError, match=r"spill_dir=.*link' is a symbolic link"):
        HostPool(pin=False, budget_bytes=1024, spill_dir=link)
    # a shared directory of root's that anyone may rename in (no sticky bit)
    open_dir = os.path.join(shared_dir, "open")
    os.mkdir(open_dir)
    os.chmod(open_dir, 0o777)
    with pytest.raises(ConfigError, match=r"writable by others without the sticky bit \(mode 777\)"):
        HostPool(pin=False, budget_bytes=1024, spill_dir=open_dir)
    assert os.listdir(theirs) == [] and os.listdir(open_dir) == []

    # a sticky shared directory like /tmp, the racer on it: the spill files never have a name to race for
    sticky = os.path.join(shared_dir, "sticky")
    os.mkdir(sticky)
    os.chmod(sticky, 0o1777)
    report = _attack(as_attacker, RACER, spill=sticky, link=link + "2", target=str(target), own=False)
    kill_later.append(report["child"])
    pool, _ = _spill(sticky)
    assert pool.spilled_bytes == pool.capacity >= 1 << 20  # all of it went through spill files
    os.kill(report["child"], signal.SIGKILL)
    assert os.listdir(sticky) == []  # nothing was ever there for the racer to see or move
    assert _snapshot(str(target)) == before
