"""The CUDA tier: tests that need a CUDA device, run on a GPU machine with ``bash bench/cuda_tier.sh``.

On a machine without one every test here is skipped, saying so. Each test records what it measured
through the ``record`` fixture; with ``ROTA_CUDA_TIER_JSON=PATH`` the session writes those figures, each
test's outcome, the commit, the date and the device to PATH (``bench/results/cuda-tier-*.json``), after every
test, so that a run cut off by a time limit keeps what finished (``"exit_status": null, "complete": false``).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before cuBLAS starts: its reproducible mode
os.environ.setdefault("TINKER_TELEMETRY", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models are built in the tests, never downloaded
NO_CUDA = "no CUDA device here: the CUDA tier runs on a GPU machine (bash bench/cuda_tier.sh; see the README)"
_figures: dict[str, dict[str, Any]] = {}
_outcomes: dict[str, str] = {}
_seconds: dict[str, float] = {}  # each test's setup + call time (the tier's budget is 10 minutes on one H200)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.cuda)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(scope="session")
def qwen3_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-0.6B-shaped Hugging Face snapshot built here (random bf16 weights, a small local tokenizer,
    ``save_pretrained``): what the engine tests serve."""
    from rota_tinker.testing import QWEN3_SHAPES, hf_snapshot

    shape = {k: v for k, v in QWEN3_SHAPES["qwen3-0.6b"].items() if k not in ("vocab_size", "tie")}
    return hf_snapshot(tmp_path_factory.mktemp("qwen3-0.6b"), "qwen3", tie=True, dtype="bfloat16",
                       max_position_embeddings=2048, **shape)  # the local tokenizer's vocabulary


@pytest.fixture
def record(request: pytest.FixtureRequest) -> Callable[..., None]:
    """``record(name=value, ...)``: figures of this test for the tier's JSON."""
    mine = _figures.setdefault(request.node.nodeid, {})
    return mine.update


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.when in ("setup", "call"):
        _seconds[item.nodeid] = _seconds.get(item.nodeid, 0.0) + report.duration
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        _outcomes[item.nodeid] = report.outcome
    if report.when == "teardown":
        _write(None)


def _commit() -> str:
    if os.environ.get("ROTA_COMMIT"):
        return os.environ["ROTA_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=os.path.dirname(__file__)).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write(int(exitstatus))


def _write(exitstatus: int | None) -> None:
    """The tier's JSON as it stands; ``exitstatus`` None: the session is still running."""
    path = os.environ.get("ROTA_CUDA_TIER_JSON")
    if not path or not _outcomes:
        return
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    out = {"tier": "cuda", "commit": _commit(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "host": platform.node(), "device": device, "torch": torch.__version__, "exit_status": exitstatus,
           "part": os.environ.get("ROTA_TIER_PART") or None, "complete": exitstatus is not None,
           "seconds": round(sum(_seconds.values()), 1),
           "tests": {nodeid: {"outcome": _outcomes[nodeid], "seconds": round(_seconds.get(nodeid, 0.0), 1),
                              **_figures.get(nodeid, {})} for nodeid in _outcomes}}
    for where in (path, *([os.path.join(os.environ["OUT"], os.path.basename(path))] if os.environ.get("OUT") else [])):
        with open(where, "w") as f:  # and into the device tool's $OUT: a call cut off still brings it back
            json.dump(out, f, indent=1, default=str)
            f.write("\n")
