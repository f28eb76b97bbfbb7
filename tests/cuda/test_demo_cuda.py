"""``rota demo --device cuda`` as a user runs it, on a real GPU: the four configurations in which parks once failed
quietly (``--state 4GB`` and ``20GB``, ``--groups 1`` and ``2``, ``--capacity 0`` so that every switch parks), and
the default (``--capacity auto``: states that fit stay resident).

Each run must exit 0 with no failed park or restore in its JSON, every curve bit-identical to its dedicated
run, and (at ``--capacity 0``) every trainer parked and restored. The figures (makespans, switch percentiles,
the time-sliced / serial ratio) go into the tier's JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

STEPS = {"4GB": "4", "20GB": "3"}


def _demo(tmp_path: Path, state: str, groups: int, capacity: str) -> tuple[dict[str, Any], str, float]:
    out = tmp_path / f"demo-{state}-{groups}-{capacity}"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "rota", "demo", "--device", "cuda", "--state", state, "--groups",
                        str(groups), "--steps", STEPS[state], "--capacity", capacity, "--out-dir", str(out)],
                       capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seconds = time.monotonic() - t0
    tail = (r.stdout + r.stderr)[-4000:]
    if os.environ.get("OUT"):  # the device tool brings $OUT back: keep every run's output
        Path(os.environ["OUT"], f"{out.name}.log").write_text(r.stdout + "\n" + r.stderr)
    assert r.returncode == 0, tail
    return json.loads((out / "demo.json").read_text()), r.stdout, seconds


@pytest.mark.parametrize("state,groups", [("4GB", 1), ("4GB", 2), ("20GB", 1), ("20GB", 2)])
def test_demo_on_cuda_parks_every_switch_with_no_failure(tmp_path: Path, state: str, groups: int,
                                                         record: Any) -> None:
    summary, stdout, seconds = _demo(tmp_path, state, groups, "0")
    ts = summary["timesliced"]
    record(seconds=seconds, timesliced_over_serial=summary["ratios"]["timesliced_over_serial_makespan"],
           serial_s=summary["serial"]["makespan_s"], timesliced_s=ts["makespan_s"], switches=ts["switches"],
           parks=ts["parks"], restores=ts["restores"], park_ms_p50=ts["park_ms_p50"], park_ms_p99=ts["park_ms_p99"],
           restore_ms_p50=ts["restore_ms_p50"], restore_ms_p99=ts["restore_ms_p99"],
           failed_parks=ts["failed_parks"], failed_restores=ts["failed_restores"], failures=ts["failures"][:3],
           bit_identical=[t["bit_identical"] for t in summary["tenants"]],
           outside_runs_s={m: [round(summary[m]["setup_s"], 1), round(summary[m]["teardown_s"], 1)]
                           for m in ("serial", "timesliced")},
           setups=summary["serial"]["setups"] + ts["setups"])
    assert ts["failed_parks"] == 0 and ts["failed_restores"] == 0, ts["failures"]
    assert all(t["bit_identical"] for t in summary["tenants"]), summary["tenants"]
    assert ts["capacity_bytes"] == 0 and ts["parks"] > 0 and ts["restores"] > 0 and ts["switches"] > 0
    assert "failed parks 0, failed restores 0" in stdout


def test_demo_on_cuda_with_its_default_capacity_keeps_states_that_fit_resident(tmp_path: Path, record: Any) -> None:
    summary, _stdout, seconds = _demo(tmp_path, "4GB", 1, "auto")
    ts = summary["timesliced"]
    ratio = summary["ratios"]["timesliced_over_serial_makespan"]
    record(seconds=seconds, timesliced_over_serial=ratio, serial_s=summary["serial"]["makespan_s"],
           timesliced_s=ts["makespan_s"], capacity_bytes=ts["capacity_bytes"], capacity_how=ts["capacity_how"],
           switches=ts["switches"], parks=ts["parks"], failed_parks=ts["failed_parks"])
    states = 6 * summary["config"]["trainer_state_bytes"]  # three jobs, a trainer and a sampler each, at most
    assert ts["capacity_how"].startswith("auto: ") and ts["capacity_bytes"] > states, ts["capacity_how"]
    assert ts["failed_parks"] == 0 and ts["failed_restores"] == 0, ts["failures"]
    assert ts["parks"] == 0  # six 4 GB states fit on the device: nothing needs to move
    assert all(t["bit_identical"] for t in summary["tenants"])
