"""bench/device_background.sh on CPU: queues that outlive the call that started them, one after another, a
failing step reported, one archive per queue, and a queue never started refused at once (not waited for).

Why the last: on a device machine recycled between calls (or a start call that never ran), ``wait`` used to
report such a queue as "running" until its time ran out, 580 s of device time for nothing (2026-12-03)."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "device_background.sh"


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"ROTA_BG_ROOT": str(tmp_path / "bg"), "OUT": str(tmp_path / "out")}
    (tmp_path / "out").mkdir(exist_ok=True)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120)


def test_queues_run_in_order_report_a_failed_step_and_leave_an_archive(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    assert _run(tmp_path, "start", "first", f"sleep 1; echo first >> {marks}", "exit 4").returncode == 0
    assert _run(tmp_path, "start", "second", "--after", "first", f"echo second >> {marks}").returncode == 0
    done = _run(tmp_path, "wait", "60", "first", "second")
    assert done.returncode == 1, done.stdout + done.stderr  # a step of "first" failed
    assert "== first: done, exit 4" in done.stdout and "== second: done, exit 0" in done.stdout
    assert marks.read_text().split() == ["first", "second"]  # "second" waited for "first"
    with tarfile.open(tmp_path / "out" / "first.tgz") as tgz:
        assert any(name.endswith("steps/02.log") for name in tgz.getnames())


def test_a_queue_still_running_is_reported_as_such(tmp_path: Path) -> None:
    assert _run(tmp_path, "start", "slow", "sleep 5").returncode == 0
    r = _run(tmp_path, "wait", "1", "slow")
    assert r.returncode == 2 and "== slow: running" in r.stdout


def test_a_queue_never_started_is_refused_at_once(tmp_path: Path) -> None:
    r = _run(tmp_path, "wait", "600", "never")
    assert r.returncode == 3 and "no queue never" in r.stderr


def test_a_bad_name_is_refused(tmp_path: Path) -> None:
    r = _run(tmp_path, "start", "../x", "true")
    assert r.returncode == 2 and "letters, digits" in r.stderr


def test_what_a_step_wrote_under_bench_results_survives_a_later_copy_of_the_tree(tmp_path: Path) -> None:
    """Each device call copies the working tree again: a file a step added under bench/results is deleted and
    one it rewrote is put back as committed (an older mtime). On the H200 (2026-12-04) the first call's tier
    JSONs and switch-cuda.json were lost so; device_collect now keeps each step's files as the step ends."""
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "device_collect.sh").write_text((ROOT / "bench" / "device_collect.sh").read_text())
    committed = repo / "bench" / "results" / "switch-cuda.json"
    committed.write_text("committed")
    os.utime(committed, (1_000_000_000, 1_000_000_000))
    resync = f"rm -f bench/results/new.json; echo committed > {committed}; touch -d @1000000000 {committed}"
    env = os.environ | {"OUT": str(tmp_path / "out"), "ROTA_COLLECT_WORK": str(tmp_path / "work")}
    (tmp_path / "out").mkdir()
    r = subprocess.run(["bash", str(repo / "bench" / "device_collect.sh"),
                        "echo measured > bench/results/switch-cuda.json; echo new > bench/results/new.json",
                        resync], capture_output=True, text=True, env=env, timeout=60, cwd=repo)
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(tmp_path / "out" / "collected.tgz") as tgz:
        got = {Path(m.name).name: tgz.extractfile(m).read().decode().strip()
               for m in tgz.getmembers() if m.isfile() and "/bench/results/" in m.name}
    assert got == {"switch-cuda.json": "measured", "new.json": "new"}, got
