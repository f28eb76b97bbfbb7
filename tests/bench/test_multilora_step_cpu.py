"""bench/multilora_step.py on the CPU (a tiny Qwen3 shape): the same code the H200 run uses, and its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "multilora_step.py")


def test_batched_lora_step_bench_runs_and_reports(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--model", "qwen3-tiny", "--dtype", "float32",
                           "--tenants", "1,3", "--steps", "1", "--warmup", "0", "--batch", "2", "--seq-len", "16",
                           "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["tenants"] for r in result["results"]] == [1, 3]
    assert result["results"][0]["step_vs_one_tenant"] == 1.0
    assert all(r["tokens_per_s"] > 0 for r in result["results"])
