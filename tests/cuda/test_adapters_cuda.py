"""The trainer adapters on a real GPU, as their users run them: rota_fsdp on an FSDP2 model (NCCL) and
rota_megatron on a Megatron-Core GPT (DDP + DistributedOptimizer), parked and restored every step.

After every park, NVML of the tenant's process is back to what it held with no model (its CUDA context,
NCCL, cuBLAS) plus at most 256 MiB; every step's loss equals the same steps unparked, bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parent.parent
MIB = 1 << 20
LIMIT = 256 * MIB


@pytest.fixture(scope="module")
def endpoint() -> Iterator[str]:
    from rota.testing import quick_config, running_orchestrator

    with running_orchestrator(quick_config()) as (served, _engine):
        yield served


def _run(args: list[str]) -> str:
    """The child's stdout (it must exit 0)."""
    r = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    return r.stdout


def _last_json_line(stdout: str) -> dict[str, Any]:
    lines = stdout.strip().splitlines()
    assert lines, "the child printed nothing: its figures were expected on the last line"
    return json.loads(lines[-1])


def test_fsdp2_parks_to_its_baseline_every_step_and_trains_bit_identically(endpoint: str, record: Any) -> None:
    from rota.testing import free_port

    got = _last_json_line(_run([str(HERE / "fsdp2_cuda_worker.py"), str(free_port()), endpoint]))
    left = [n - got["baseline_bytes"] for n in got["after_park_bytes"]]
    record(state_bytes=got["state_bytes"], parked_bytes=got["parked_bytes"], baseline_bytes=got["baseline_bytes"],
           left_after_park_bytes=left, losses=got["losses"], failed=got["failed"])
    assert got["failed"] == 0
    assert got["losses"] == got["reference"]
    assert all(n >= got["state_bytes"] * 0.99 for n in got["parked_bytes"])
    assert max(left) <= LIMIT, f"a park left {max(left) / MIB:.0f} MiB beside the baseline"


def test_megatron_parks_to_its_baseline_every_step_and_trains_bit_identically(tmp_path: Path, record: Any) -> None:
    out = tmp_path / "megatron.json"
    # its figures go to --out, not to stdout
    _run([str(ROOT / "bench" / "megatron_switch.py"), "--device", "cuda", "--hidden", "1024", "--layers", "4",
          "--vocab", "32768", "--steps", "4", "--out", str(out)])
    got = json.loads(out.read_text())
    base = got["memory"]["after_reference_freed"]["nvml_process"]  # context, NCCL, cuBLAS: no model
    left = [m["nvml_process"] - base for m in got["memory"]["after_park"]]
    record(state_bytes=got["state_bytes"], left_after_park_bytes=left, park_vs_floor=got["park_vs_floor"],
           restore_vs_floor=got["restore_vs_floor"], failed=got["failed"])
    assert got["failed"] == 0
    assert got["losses_bit_identical"] and got["state_bit_identical"], got["state_mismatched"]
    assert max(left) <= LIMIT, f"a park left {max(left) / MIB:.0f} MiB beside the baseline"
