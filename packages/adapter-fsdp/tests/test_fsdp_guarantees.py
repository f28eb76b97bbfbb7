"""Switch guarantees with real tenant processes: residue faults, rolled-back parks, refused restores.

Each test runs the orchestrator in this process, one tenant in a subprocess
(``guard_worker.py``) and a second tenant here that must still get its turn.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rota
from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator

WORKER = Path(__file__).with_name("guard_worker.py")


def _wait(path: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}: {proc.stderr.read().decode()[-3000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


def _run(mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> tuple[dict, object]:
    env = {**os.environ, "ROTA_RESIDUE_MAX_BYTES": str(1 << 20), "PYTHONUNBUFFERED": "1"}
    with running_orchestrator(OrchestratorConfig(ttl_s=5.0, park_timeout_s=30.0)) as (endpoint, engine):
        proc = subprocess.Popen([sys.executable, str(WORKER), mode, endpoint, str(tmp_path)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            _wait(tmp_path / "ready", proc)
            other = rota.connect(group="g", tenant="other", endpoint=endpoint)
            with caplog.at_level(logging.ERROR, logger="rota._orchestrator"):
                grant = other.acquire()  # the worker is parked (or faulted) first; the group moves on
            assert grant.job_id == "other"
            state = engine.groups["g"].tenants[f"{mode}-job"].state
            other.release()
            (tmp_path / "go").touch()
            _wait(tmp_path / "result.json", proc)
            proc.wait(timeout=60)
            other.close()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    assert proc.returncode == 0, proc.stderr.read().decode()[-3000:]
    return json.loads((tmp_path / "result.json").read_text()), state


def test_forgotten_tensor_faults_the_parked_tenant_and_the_next_one_runs(tmp_path, caplog):
    result, state = _run("leak", tmp_path, caplog)
    assert state == "faulted"
    assert "untracked:0.cache" in caplog.text and "ROTA_RESIDUE_MAX_BYTES" in caplog.text
    assert result["residue"]["untracked:0.cache"] == 4 << 20
    assert result["parked"] is True  # its state is parked; the retry below restored it and trained
    assert result["loss"] > 0


def test_park_that_hangs_is_rolled_back_and_the_group_keeps_serving(tmp_path, caplog):
    result, state = _run("hang", tmp_path, caplog)
    assert state == "faulted"
    assert "deadline" in caplog.text and "rolled back" in caplog.text
    assert result["parked"] is False and result["weights_resident"] is True  # rollback: still resident
    assert result["loss"] > 0  # FAULTED was retryable


def test_corrupted_host_copy_is_refused_at_restore(tmp_path, caplog):
    result, _ = _run("corrupt", tmp_path, caplog)
    assert "VerifyError" in result["error"] and "does not match its fingerprint" in result["error"]
    assert result["parked_after_refusal"] is True and result["weights_freed"] is True
