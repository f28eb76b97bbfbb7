"""``rota demo --engine vllm`` on a real GPU (issue 42): two GRPO jobs and one SFT job whose engines are in-process
``vllm.LLM`` (sleep mode, tracked by ``rota_vllm``), trainers tracked by ``rota_fsdp``, every mode in one run.

* ``tiny`` at ``--capacity 0`` (every switch parks, engines included): each job's loss and reward curves in the
  time-sliced run equal the dedicated run's step for step (vLLM's seeded per-request sampling, the same batch in
  every mode), no park or restore failed, every trainer and every engine parked at least once.
* ``h200`` (Qwen3-0.6B/1.7B/4B shapes, ``--capacity auto``): the figures of issue 42 item 5 (makespan ratio,
  busy, switches, parks with their percentiles, rewards first and last) go into the tier's JSON; its
  assertions are only that the run finishes with no failed park and identical curves (first run: an H200 at
  50d40b9, passed; the figures in rota-demo's README). On a card under 120 GiB (an H100) the demo must refuse
  these shapes before building anything: that is checked there.
* ``h100`` (the same jobs sized for one 80 GB card, ``--capacity auto``): the same figures and assertions, on a
  card under 120 GiB (on an H200 the h200 shapes are the experiment: skipped there).

Needs vLLM (0.26.0 on the H200 host: bench/stage_wheels.py) importable; skipped otherwise, saying so.
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

pytestmark = pytest.mark.engines  # the tier's engines part (ROTA_TIER_PART=engines bash bench/cuda_tier.sh)

pytest.importorskip("vllm", reason="vllm is not importable here: stage vllm 0.26.0 on the GPU machine with "
                                   "bench/stage_wheels.py (see the README), then run the tier")
pytest.importorskip("transformers", reason="rota demo --engine vllm builds its checkpoints with transformers")

ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "PYTHONUNBUFFERED": "1",
       "HF_HUB_OFFLINE": "1"}


def _demo(tmp_path: Path, size: str, steps: int, capacity: str, timeout: int,
          off_device: float = 0.05) -> tuple[dict[str, Any], float]:
    """Run the demo, its output streamed into a log as it runs ($OUT's when the device tool sets it, so that a run
    stopped by a timeout still shows how far it got); the summary and the seconds it took."""
    out = tmp_path / f"demo-vllm-{size}-{capacity}"
    logs = Path(os.environ["OUT"]) if os.environ.get("OUT") else tmp_path
    log = logs / f"{out.name}.log"
    t0 = time.monotonic()
    with log.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "rota", "demo", "--engine", "vllm", "--device", "cuda",
                                 "--groups", "1", "--llm-size", size, "--steps", str(steps), "--capacity", capacity,
                                 "--off-device", str(off_device), "--cache-dir", str(tmp_path / "ckpt"), "--out-dir",
                                 str(out)], stdout=f, stderr=subprocess.STDOUT, text=True, env={**os.environ, **ENV})
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    seconds = time.monotonic() - t0
    if os.environ.get("OUT"):  # the device tool brings $OUT back: keep the summary and the plot too
        for name in ("demo.json", "demo-timeline.png"):
            if (out / name).exists():
                Path(os.environ["OUT"], f"{out.name}-{name}").write_bytes((out / name).read_bytes())
    tail = log.read_text()[-4000:]
    assert rc is not None, f"rota demo did not finish in {timeout} s; its output ends:\n{tail}"
    assert rc == 0, f"rota demo exited {rc}; its output ends:\n{tail}"
    return json.loads((out / "demo.json").read_text()), seconds


def _figures(summary: dict[str, Any], seconds: float) -> dict[str, Any]:
    ts, curves = summary["timesliced"], summary["curves"]
    diffs = {name: max((abs(a - b) for a, b in zip(values, curves["timesliced"][name], strict=True)), default=0.0)
             for name, values in curves["dedicated"].items()}
    return dict(seconds=seconds, timesliced_over_serial=summary["ratios"]["timesliced_over_serial_makespan"],
                timesliced_floor_over_serial=summary["ratios"]["timesliced_floor_over_serial_makespan"],
                serial_s=summary["serial"]["makespan_s"], timesliced_s=ts["makespan_s"],
                busy_fraction=ts["busy_fraction"], switches=ts["switches"], parks=ts["parks"],
                parks_by_worker=ts["parks_by_worker"], park_ms_p50=ts["park_ms_p50"], park_ms_p99=ts["park_ms_p99"],
                restore_ms_p50=ts["restore_ms_p50"], restore_ms_p99=ts["restore_ms_p99"],
                wait_ms_p50=ts["wait_ms_p50"], wait_ms_p99=ts["wait_ms_p99"], failed_parks=ts["failed_parks"],
                failed_restores=ts["failed_restores"], failures=ts["failures"][:3], adapters=ts["adapters"],
                footprints=ts.get("footprints"), prefetch=ts["prefetch"], capacity_bytes=ts["capacity_bytes"],
                max_abs_diff_dedicated_vs_timesliced=diffs,
                sampler_first_last={t["name"]: (t.get("sampler_first"), t.get("sampler_last"))
                                    for t in summary["tenants"]},
                bit_identical=[t["bit_identical"] for t in summary["tenants"]],
                pretraining={job: m.get("pretraining") for job, m in summary["config"]["models"].items()})


@pytest.mark.timeout(600)  # the run's own limit is 540 s
def test_demo_vllm_tiny_parks_every_switch_and_learns_identically(tmp_path: Path, record: Any) -> None:
    summary, seconds = _demo(tmp_path, "tiny", 8, "0", 540)
    record(**_figures(summary, seconds))
    ts, curves = summary["timesliced"], summary["curves"]
    assert ts["failed_parks"] == 0 and ts["failed_restores"] == 0, ts["failures"][:3]
    assert "rota_vllm" in ts["adapters"] and "rota_fsdp" in ts["adapters"], ts["adapters"]
    assert all(n >= 1 for n in ts["parks_by_worker"].values()), ts["parks_by_worker"]  # engines too, at capacity 0
    for name, values in curves["dedicated"].items():
        assert curves["serial"][name] == values and curves["timesliced"][name] == values, name


@pytest.mark.timeout(1200)  # three checkpoints built, nine engines started; the run's own limit is 1,100 s
def test_demo_vllm_h200_sizes_report_the_issue_figures(tmp_path: Path, record: Any) -> None:
    import torch

    if torch.cuda.get_device_properties(0).total_memory < 120 << 30:  # an 80 GB card: refused before any build
        r = subprocess.run([sys.executable, "-m", "rota", "demo", "--engine", "vllm", "--device", "cuda",
                            "--groups", "1", "--llm-size", "h200", "--steps", "1", "--cache-dir",
                            str(tmp_path / "ckpt"), "--out-dir", str(tmp_path / "out")], capture_output=True,
                           text=True, timeout=300, env={**os.environ, **ENV})
        record(refused=r.stderr[-600:])
        assert r.returncode == 1 and "needs about" in r.stderr and "--llm-size tiny" in r.stderr, r.stderr[-2000:]
        assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir()), "it built checkpoints"
        pytest.skip("the h200 shapes need one H200; refused here before building anything, as they must be")
    _sized_run(tmp_path, record, "h200")


def _sized_run(tmp_path: Path, record: Any, size: str) -> None:
    """The issue's experiment at ``--llm-size SIZE``, ``--capacity auto``: its figures recorded; no park or restore
    failed and every job's curves equal its dedicated run's. Twelve steps with 0.6 s off the device each (a reward
    judge or an environment): at 50d40b9 four steps of 0.05 s left the serial run's device busy 88%, so no
    schedule could have come under 0.89x serial, and at 0.3 s (the h100 shapes at 9ce0a14) the floor was 0.64x;
    with the issue's two targets together (<= 0.75x serial, device busy >= 80%) a run must land between its floor
    and 1.25x it, which 0.6 s leaves room for (about 0.55x-0.69x at the h200 shapes' step times)."""
    summary, seconds = _demo(tmp_path, size, 12, "auto", 1100, off_device=0.6)
    record(**_figures(summary, seconds))
    ts = summary["timesliced"]
    assert ts["failed_parks"] == 0 and ts["failed_restores"] == 0, ts["failures"][:3]
    assert all(t["bit_identical"] for t in summary["tenants"]), summary["tenants"]


@pytest.mark.timeout(1200)
def test_demo_vllm_h100_sizes_report_the_issue_figures(tmp_path: Path, record: Any) -> None:
    import torch

    if torch.cuda.get_device_properties(0).total_memory >= 120 << 30:
        pytest.skip("a card of 120 GiB or more holds the h100 shapes at once: the h200 shapes are its experiment")
    _sized_run(tmp_path, record, "h100")
