"""bench/cli_startup.py as the README's start-up figures come from it: every case runs, the JSON has each
case's median and best, and rota's errors name the address they tried (no orchestrator, a silent server)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "cli_startup.py")


def test_cli_startup_bench_runs_every_case_and_checks_the_errors(tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, BENCH, "--runs", "1", "--silent-timeout", "0.5", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert set(result["cases"]) == {"help", "status_no_orchestrator", "status_served", "status_silent"}
    assert all(row["this"]["best_s"] > 0 for row in result["cases"].values())
    assert result["cases"]["status_silent"]["this"]["median_s"] >= 0.5  # it waited its --timeout, then failed
    assert result["checks"]["this"] == {"status_no_orchestrator_rc": 1, "status_no_orchestrator_names_address": True,
                                        "status_silent_rc": 1, "status_silent_names_address": True}


def test_a_baseline_that_is_not_an_executable_is_refused_naming_it(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--baseline", str(tmp_path / "nope")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and f"--baseline {str(tmp_path / 'nope')!r} is not an executable" in proc.stderr
