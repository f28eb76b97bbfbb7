"""bench/multigpu_switch.py on the CPU (gloo, tiny models): the same code as the 2-GPU run.

Two 2-rank jobs of one group, each rank its own process, a real orchestrator: every
switch parks one job on both ranks and restores the other, and every rank's losses and
final state equal its run without rota.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "multigpu_switch.py")


@pytest.mark.slow
@pytest.mark.parametrize("framework", ["fsdp2", "megatron"])
def test_two_jobs_of_two_ranks_take_turns_bit_identically(framework, tmp_path):
    if framework == "megatron" and importlib.util.find_spec("megatron") is None:
        pytest.skip("megatron-core is not installed")
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    proc = subprocess.run([sys.executable, BENCH, "--framework", framework, "--device", "cpu", "--turns", "3",
                           "--timeout", "240", "--out", str(out), "--tmp", str(tmp_path / "ranks")],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["all_bit_identical"] and not result["hung"]
    assert result["switches"] >= 3  # the jobs alternated
    assert len(result["ranks"]) == 4
    for rank in result["ranks"]:
        assert rank["parks"] >= 2 and rank["restores"] >= 2, rank
        assert rank["losses_bit_identical"] and rank["state_bit_identical"]
        assert rank["park_vs_floor"] > 0 and rank["restore_vs_floor"] > 0
    if framework == "megatron":
        assert result["model"]["tp"] == 2
