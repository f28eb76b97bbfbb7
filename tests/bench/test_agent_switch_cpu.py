"""bench/agent_switch.py's whole-process part on the CPU: the same code as the H200 run but for the driver.

Tenant processes register with a real agent the way a real job does (a WorkloadClient with backend cuda over
the agent's Unix socket, each pid proven by its door); the agent parks the job's proven pids through its
cuda backend, whose libcuda is replaced by the bench's FakeCudaDriver (``--driver fake``: no GPU here).
So a regression in registration, pid proof, the backend's steps or the bench's failure accounting is caught
without a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench", "agent_switch.py")


def _run(tmp_path, *args: str, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "out"
    base = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    proc = subprocess.run([sys.executable, BENCH, "--device", "cpu", "--parts", "cuda", "--driver", "fake",
                           "--sizes", "16MB", "--out", str(out), *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=240)
    return proc, json.loads((out / "agent-cpu.json").read_text())


def test_registered_tenants_are_parked_by_their_proven_pids_serially_or_at_once(tmp_path):
    proc, result = _run(tmp_path, "--procs", "2", "--parallel", "1,8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["failures"] == [] and [c["parallel"] for c in result["whole_process_cuda"]] == [1, 8]
    for case in result["whole_process_cuda"]:
        pids = case["pids"]
        assert len(set(pids)) == 2 and case["stored_bytes"] == 16 * 10**6
        (run,) = case["runs"]
        assert run["bit_identical"] is True
        for kind, calls in (("park", ("lock", "checkpoint")), ("restore", ("restore", "unlock"))):
            steps = run[f"{kind}_steps"]
            assert sorted(steps) == sorted(calls), steps
            for call in calls:  # the driver acted on exactly the processes that registered
                assert steps[call]["pids"] == pids
                assert steps[call]["at_once"] == min(case["parallel"], 2), (call, steps[call])
        assert case["park_s"] > 0 and case["restore_s"] > 0 and case["park_GBps"] > 0


def test_a_failed_park_is_counted_and_the_bench_exits_1_naming_it(tmp_path):
    proc, result = _run(tmp_path, "--procs", "2", "--fake-fail", "checkpoint")
    assert proc.returncode == 1
    (failure,) = result["failures"]
    assert failure["step"] == "park" and "FAKE_FAILURE" in failure["error"]
    assert "park: cuCheckpointProcessCheckpoint of pid" in proc.stderr
    (case,) = result["whole_process_cuda"]
    assert "park_s" not in case  # no figure from a failed park
    steps = case["runs"][0]["park_steps"]
    assert steps["unlock"]["pids"] == case["pids"]  # the backend rolled both back


def test_a_tenant_that_cannot_prove_its_pid_is_refused_and_counted(tmp_path):
    """A misplaced pid door (ROTA_AGENT_PROOF): the tenants register without a proof, which the cuda
    backend needs, so the agent refuses them; the bench counts it and exits 1."""
    proc, result = _run(tmp_path, "--procs", "1", env={"ROTA_AGENT_PROOF": str(tmp_path / "no-door.sock")})
    assert proc.returncode == 1
    (failure,) = result["failures"]
    assert failure["step"] == "register" and "did not prove" in failure["error"], failure
    assert "register:" in proc.stderr
