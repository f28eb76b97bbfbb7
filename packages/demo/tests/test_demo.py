"""`rota demo` end to end on the CPU: real torch workers in real processes, a real
orchestrator, the adapter parking state between turns; every loss curve of the
time-sliced run must equal its dedicated run bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch", reason="the demo needs torch (installed by ./dev setup)")


@pytest.mark.slow
def test_demo_small_run_is_bit_identical_and_reports_everything(tmp_path):
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--steps", "6", "--hidden", "64", "--layers", "2",
                        "--off-device", "0.05", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert {"dedicated", "serial", "timesliced", "tenants", "ratios"} <= summary.keys()
    assert summary["serial"]["makespan_s"] > 0 and 0 < summary["timesliced"]["busy_fraction"] <= 1
    assert [t["name"] for t in summary["tenants"]] == ["rl-a", "rl-b", "sft"]
    assert all(t["bit_identical"] is True for t in summary["tenants"])
    assert summary["config"]["sft_turns"] == 4  # SFT steps split into 4 turns, in every mode alike
    ts = summary["timesliced"]
    assert ts["switches"] > 0
    assert ts["failed_parks"] == 0 and ts["failed_restores"] == 0 and ts["failures"] == []
    assert ts["capacity_bytes"] == 0 and "every switch parks" in ts["capacity_how"]  # auto on CPU: 0
    if "rota_fsdp" in ts["adapters"]:  # with the adapter installed, switches really park and restore
        assert ts["parks"] > 0 and ts["restores"] > 0 and ts["bytes_moved"] > 0
    assert "time-sliced makespan / serial makespan" in r.stdout
    # the floor: the serial run's busiest device's turns (trainers' and samplers' apart), or the longest job alone
    ser, floor = summary["serial"], summary["ratios"]["timesliced_floor_over_serial_makespan"]
    work = max(ser["trainer_device_busy"], ser["sampler_device_busy"]) * ser["makespan_s"]
    assert floor * ser["makespan_s"] == pytest.approx(max(work, summary["dedicated"]["makespan_s"]))
    assert 0 < floor <= 1 and "no time-sliced schedule of this work does better than" in r.stdout
    assert "host memory: about" in r.stderr  # the estimate is in the header
    # the wall time outside the measured runs: one set-up per run alone, one for time-sliced, each phase named
    assert [s["label"] for s in summary["serial"]["setups"]] == ["rl-a alone", "rl-b alone", "sft alone"]
    (setup,) = ts["setups"]
    assert setup["label"] == "time-sliced" and setup["last_ready"].count("/") == 1
    assert 0 < sum(setup["phases_s"].values()) <= setup["setup_s"] == ts["setup_s"] and ts["teardown_s"] > 0
    # every worker's marks, in the order reached, from the first spawn: the last ready's end at its set-up's end
    assert len(setup["marks_s"]) == 6 and all(list(m.values()) == sorted(m.values()) and m["ready"] <= setup["setup_s"]
                                              for m in setup["marks_s"].values())
    assert setup["marks_s"][setup["last_ready"]]["ready"] == max(m["ready"] for m in setup["marks_s"].values())
    assert list(setup["marks_s"][setup["last_ready"]])[:2] == ["entered", "torch"]
    assert "[time-sliced] 6 workers ready in" in r.stderr and "outside the measured runs" in r.stdout
    assert (tmp_path / "demo-timeline.png").stat().st_size > 10_000


def test_demo_is_a_plugin_command_of_rota():
    """Core has no demo: `rota demo` comes from rota_demo's entry point, through the rota_cli hook."""
    from importlib.metadata import entry_points

    assert {ep.name: ep.value for ep in entry_points(group="rota")}.get("rota_demo") == "rota_demo.plugin"
    r = subprocess.run([sys.executable, "-m", "rota", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "could not add its commands" not in r.stderr, r.stderr
    assert any(line.split()[:1] == ["demo"] for line in r.stdout.splitlines()), r.stdout


@pytest.mark.parametrize("args,needle", [
    (["--groups", "3"], "--groups"),
    (["--modes", "fast"], "choose from dedicated, serial, timesliced"),
    (["--state", "huge"], "'huge' is not a size"),
    (["--device", "tpu"], "use cpu or cuda"),
    (["--sft-turns", "5"], "divide --batch 64"),
    (["--capacity", "lots"], "'lots' is not a size"),
    (["--engine", "vllm", "--engine-memory", "lots"], "give fractions of the device"),
    (["--engine", "vllm", "--engine-memory", "0.2,0.3"], "one fraction for every job, or three"),
    (["--engine", "vllm", "--engine-memory", "0.2,0,0.3"], "above 0 and at most 0.95"),
    (["--engine", "vllm", "--engine-memory", "nan"], "above 0 and at most 0.95"),
    (["--engine", "vllm", "--engine-memory", "1.2"], "above 0 and at most 0.95"),
    (["--engine", "hf", "--engine-memory", "0.2"], "use it with --engine vllm"),
])
def test_demo_rejects_bad_options(args, needle):
    r = subprocess.run([sys.executable, "-m", "rota", "demo", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and needle in r.stderr, r.stderr


@pytest.mark.slow
def test_demo_with_capacity_prefetches_the_next_trainer_and_stays_bit_identical(tmp_path):
    """Two trainers fit on the device, three do not: during one trainer's turn rota parks an
    idle one and restores the next (prefetch), and the losses still match the dedicated run."""
    from rota_demo.workloads import ModelSize

    capacity = int(2.2 * ModelSize(hidden=64, layers=2).trainer_state_bytes)
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--steps", "6", "--hidden", "64", "--layers", "2",
                        "--off-device", "0.05", "--capacity", str(capacity), "--modes", "dedicated,timesliced",
                        "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    summary = json.loads((tmp_path / "demo.json").read_text())
    assert all(t["bit_identical"] is True for t in summary["tenants"])
    ts = summary["timesliced"]
    assert ts["capacity_bytes"] == capacity and ts["parks"] > 0
    assert ts["prefetch"]["hits"] > 0 and ts["prefetch"]["failures"] == 0, ts["prefetch"]
    assert "prefetch (next tenant restored during the holder's turn)" in r.stdout
    # what fits: each worker's largest footprint as rota counted it, per group (trainers gpu0, samplers gpu1)
    fp, state = ts["footprints"], ModelSize(hidden=64, layers=2).trainer_state_bytes
    assert sorted(fp["gpu0"]) == ["rl-a/trainer", "rl-b/trainer", "sft/trainer"], fp
    assert all(sum(tags.values()) >= state and {"weights", "optimizer"} <= tags.keys() for tags in fp["gpu0"].values())
    assert sum(sum(tags.values()) for tags in fp["gpu0"].values()) > capacity  # three trainers do not fit: parks
    assert "gpu0: rl-a/trainer" in r.stdout and "they do not all fit at once, so the policy parks" in r.stdout


@pytest.mark.slow
def test_demo_whose_parks_all_time_out_finishes_and_fails_naming_them(tmp_path):
    """Every park runs past a 0.1 µs deadline and is rolled back: the jobs are FAULTED again and
    again, and retry. A job whose park failed while it waited in the queue used to keep an
    acquire that no grant could answer, and the demo hung until its worker timeout. The run
    finishes, writes everything, and exits non-zero naming the failed parks: a failed park is
    never a quiet success (it once printed bit-identical and exited 0)."""
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--steps", "3", "--hidden", "64", "--layers", "2",
                        "--modes", "timesliced", "--off-device", "0.05", "--out-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=240, cwd=tmp_path,
                       env={**os.environ, "ROTA_SWITCH_DEADLINE_S": "0.0000001"})
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "park of" in r.stderr and "FAULTED" in r.stderr  # the parks really failed
    summary = json.loads((tmp_path / "demo.json").read_text())
    ts = summary["timesliced"]
    assert ts["failed_parks"] > 0 and ts["failures"][0]["kind"] == "park"
    assert "SwitchTimeout" in ts["failures"][0]["error"]
    assert f"{ts['failed_parks']} failed park(s)" in r.stderr and "SwitchTimeout" in r.stderr
    assert f"failed parks {ts['failed_parks']}" in r.stdout  # in the summary too
