"""Issue 30, item 5: the node ledger is nobody's weapon.

The attacker (a second uid) had three ways to hurt others through the node's host-memory
ledger: a ``sleep`` "claiming" 25 GB counted against everyone's node budget; making the
ledger's root, or ``<root>/<victim uid>``, first, so the victim got ``ConfigError``; and
the refusal then named the per-process budget instead of the node's. Here the victim is root
(this test process, its pools), the attacker runs through ``setpriv``; each test checks the
victim still parks what it would have parked alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap

import pytest

from rota_torch import HostBudgetExceeded, HostPool, _ledger, node_host_bytes
from tests.security.test_local_files import MB, _attack, kill_later, shared_dir  # noqa: F401  (fixtures)

SLEEPER_CLAIMS = """
    import time
    child = detach(lambda: time.sleep(300))  # a live process of the attacker's uid that holds next to nothing
    with open(f"/proc/{child}/stat") as f:
        start = f.read().rsplit(")", 1)[1].split()[19]
    mine = os.path.join(root, str(os.getuid()))
    os.makedirs(mine, exist_ok=True)
    os.chmod(mine, 0o755)
    with open(os.path.join(mine, str(child)), "w") as f:
        f.write(f"{start} {claim}\\n")
    report["child"] = child
"""


@pytest.fixture
def budget(monkeypatch, shared_dir):  # noqa: F811
    os.chmod(shared_dir, 0o1777)  # the node's ledger root as root makes it
    monkeypatch.setenv("ROTA_NODE_LEDGER_DIR", shared_dir)
    monkeypatch.setenv("ROTA_NODE_HOST_BUDGET_BYTES", str(100 * MB))
    monkeypatch.delenv("ROTA_HOST_BUDGET_BYTES", raising=False)
    monkeypatch.delenv("ROTA_SPILL_DIR", raising=False)
    return shared_dir


def test_a_claim_counts_only_what_its_process_holds(as_attacker, budget, kill_later, caplog):  # noqa: F811
    report = _attack(as_attacker, SLEEPER_CLAIMS, root=budget, claim=90 * MB)
    kill_later.append(report["child"])
    caplog.set_level(logging.WARNING, logger="rota_torch._ledger")
    counted = node_host_bytes()[report["child"]]
    with open(f"/proc/{report['child']}/smaps_rollup") as f:
        pss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
    assert 0 < counted <= pss * 1.1 and counted < 20 * MB  # its few MB (its share of its pages), not the 90
    assert "claims 94371840 bytes but its process holds" in caplog.text
    pool = HostPool(pin=False, spill_dir="")
    pool.reserve(60 * MB)  # room the claimed 90 MB would have taken away
    assert pool.capacity >= 60 * MB


def test_nobody_can_make_a_path_that_locks_another_out(as_attacker, budget, kill_later):  # noqa: F811
    report = _attack(as_attacker, """
    attempt("squat the victim's directory", lambda: os.mkdir(os.path.join(root, "0"), 0o755))
    attempt("squat the next one", lambda: os.mkdir(os.path.join(root, "0.1"), 0o777))
    """, root=budget)
    assert report == {"squat the victim's directory": "done", "squat the next one": "done"}
    pool = HostPool(pin=False, spill_dir="")
    pool.reserve(10 * MB)  # was ConfigError: "/0' is owned by uid ... it must be yours"
    assert node_host_bytes() == {os.getpid(): pool.capacity}
    (own,) = [n for n in os.listdir(budget) if n.startswith("0.") and os.stat(f"{budget}/{n}").st_uid == 0]
    assert stat.S_IMODE(os.stat(f"{budget}/{own}").st_mode) == 0o755
    assert os.listdir(f"{budget}/0") == [] and os.listdir(f"{budget}/0.1") == []  # nothing written there


def test_a_node_root_made_by_another_user_locks_nobody_out(as_attacker, monkeypatch, shared_dir, tmp_path):  # noqa: F811
    """The default root, made by a user before root: neither that user nor root is refused."""
    default = os.path.join(shared_dir, "rota-host-ledger")
    os.chmod(shared_dir, 0o1777)
    report = _attack(as_attacker, f"""
    import sys
    sys.path[:0] = {[p for p in __import__("sys").path if p]!r}
    from rota_torch import _ledger, HostPool
    _ledger.DEFAULT_DIR = root
    os.environ["XDG_RUNTIME_DIR"] = private
    HostPool(pin=False, spill_dir="").reserve(1 << 20)   # a non-root user's first run
    report["made the root"] = os.path.exists(root)
    attempt("plant the root", lambda: os.mkdir(root, 0o755))
    """, root=default, private=str(tmp_path / "attacker-runtime"))
    assert report == {"made the root": False, "plant the root": "done"}  # its first run made nothing there
    monkeypatch.setattr(_ledger, "DEFAULT_DIR", default)
    (tmp_path / "root-runtime").mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "root-runtime"))
    monkeypatch.delenv("ROTA_NODE_LEDGER_DIR", raising=False)
    monkeypatch.setenv("ROTA_NODE_HOST_BUDGET_BYTES", str(100 * MB))
    pool = HostPool(pin=False, spill_dir="")
    pool.reserve(10 * MB)  # was ConfigError: owned by another uid; now this user's own ledger, with a warning
    assert node_host_bytes() == {os.getpid(): pool.capacity}
    assert os.listdir(default) == []


def test_the_refusal_names_the_node_budget(budget):
    """Other processes already past the node budget: the refusal names ROTA_NODE_HOST_BUDGET_BYTES, not the
    per-process ROTA_HOST_BUDGET_BYTES (the node's room is clamped at 0, which the old comparison missed)."""
    code = textwrap.dedent("""
        import time
        from rota_torch import HostPool
        HostPool(pin=False, chunk_bytes=1 << 20).reserve(110 << 20)
        print("ready", flush=True)
        time.sleep(600)
    """)
    env = dict(os.environ, ROTA_NODE_HOST_BUDGET_BYTES=str(1 << 40))  # it came first, under a larger budget
    other = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert other.stdout is not None and other.stdout.readline().strip() == "ready"
        with pytest.raises(HostBudgetExceeded) as info:
            HostPool(pin=False, spill_dir="", budget_bytes=1 << 40).reserve(10 * MB)
        text = str(info.value)
        assert "node budget (ROTA_NODE_HOST_BUDGET_BYTES)" in text and "raise ROTA_HOST_BUDGET_BYTES" not in text
    finally:
        other.kill()
        other.wait()


SHARED_MAPPINGS = """
    import mmap
    path = os.path.join(private, "cache.bin")
    with open(path, "wb") as f:
        f.write(b"x" * size)  # one file in the page cache, mapped by each of the children below

    def hold():
        with open(path, "rb") as f:
            m = mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ)
        sum(m[i] for i in range(0, size, 4096))  # every page mapped in this process: its VmRSS grows by size
        time.sleep(300)

    children = [detach(hold) for _ in range(copies)]
    mine = os.path.join(root, str(os.getuid()))
    os.makedirs(mine, exist_ok=True)
    os.chmod(mine, 0o755)
    for child in children:
        while True:  # until the child's mapping shows in its VmRSS
            with open(f"/proc/{child}/status") as f:
                rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            if rss >= size:
                break
            time.sleep(0.01)
        with open(f"/proc/{child}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]
        with open(os.path.join(mine, str(child)), "w") as f:
            f.write(f"{start} {size}\\n")  # each claims the whole file
    report["children"] = children
"""


def test_pages_several_processes_map_count_once(as_attacker, attacker_uid, budget, kill_later):  # noqa: F811
    """Row 13 of issue 45: six processes of the attacker map one page-cache file and each claims it whole. Each
    process's VmRSS holds the file, so the old bound counted it six times (6 x 40 MB against a 100 MB node budget)
    and refused the victim's 30 MB; its proportional share (Pss) counts it once across them."""
    private = tempfile.mkdtemp(prefix="rota-sec-", dir="/tmp")
    os.chown(private, *attacker_uid)
    size, copies = 40 * MB, 6
    try:
        report = _attack(as_attacker, SHARED_MAPPINGS, root=budget, private=private, size=size, copies=copies)
        kill_later.extend(report["children"])
        counted = node_host_bytes()
        theirs = sum(counted[c] for c in report["children"])
        assert size * 0.9 <= theirs <= size + 24 * MB, theirs  # the file once (and their interpreters' shares)
        pool = HostPool(pin=False, spill_dir="")
        pool.reserve(30 * MB)  # was HostBudgetExceeded: "other rota processes on this node hold 0.252 GB"
        assert pool.capacity >= 30 * MB
    finally:
        shutil.rmtree(private, ignore_errors=True)
