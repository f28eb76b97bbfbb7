"""`rota demo` as an operator meets it: Ctrl-C stops every worker with one line and no traceback; the timeline
shows which rows share a device; --seed says what it seeds.

Real parts: `rota demo` in its own session of processes (real torch workers, a real orchestrator), interrupted
with SIGINT to the whole process group as a terminal's Ctrl-C is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("torch", reason="the demo needs torch (installed by ./dev setup)")


def test_ctrl_c_stops_every_worker_without_tracebacks(tmp_path):
    demo = subprocess.Popen([sys.executable, "-m", "rota", "demo", "--steps", "500", "--hidden", "16", "--layers",
                             "1", "--batch", "4", "--seq", "4", "--modes", "timesliced", "--off-device", "0.05",
                             "--out-dir", str(tmp_path)], stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert demo.stderr is not None
    try:
        for line in demo.stderr:  # the workers run: their steps are reported
            if "[time-sliced]" in line and " step " in line:
                break
        else:
            pytest.fail("the demo ended before its workers ran")
        os.killpg(demo.pid, signal.SIGINT)  # what Ctrl-C in the terminal sends: the demo and every worker
        rest = demo.stderr.read()
        demo.wait(timeout=60)
    finally:
        if demo.poll() is None:
            os.killpg(demo.pid, signal.SIGKILL)
    assert demo.returncode == 130, rest
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest
    assert rest.strip().splitlines()[-1] == "rota demo: interrupted; every worker stopped, nothing written"
    assert not (tmp_path / "demo.json").exists()
    deadline = time.monotonic() + 30
    while True:  # no process of the demo's session is left (workers included)
        try:
            os.killpg(demo.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "a worker of the interrupted demo is still running"
        time.sleep(0.1)


def test_timeline_lanes_band_the_workers_of_each_shared_device():
    from rota_demo.report import timeline_lanes
    from rota_demo.runner import ModeResult
    from rota_demo.worker import WorkerReport

    names = ("sft/sampler", "rl-a/trainer", "rl-b/sampler", "sft/trainer", "rl-a/sampler", "rl-b/trainer")
    shared = ModeResult("timesliced", 1.0, 2, {n: WorkerReport(n, group="gpu0" if n.endswith("trainer") else "gpu1")
                                              for n in names})
    lanes = timeline_lanes(shared)
    assert [g for _, _, g in lanes] == ["gpu0"] * 3 + ["gpu1"] * 3  # each device's rows together
    assert lanes[0] == ("rl-a/trainer", "rl-a/trainer [gpu0]", "gpu0")
    alone = ModeResult("dedicated", 1.0, 6, {n: WorkerReport(n) for n in names})
    assert {label.split(" ", 1)[1] for _, label, _ in timeline_lanes(alone)} == {"[own device]"}


def test_seed_has_help():
    out = subprocess.run([sys.executable, "-m", "rota", "demo", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert "--seed INTEGER" in out.stdout and "job i uses SEED+i" in " ".join(out.stdout.split())
