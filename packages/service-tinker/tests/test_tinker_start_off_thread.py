"""A sample whose worker must start first holds no HTTP thread while it starts.

A sampler (or the base holder) starts on a tenant's first sample: seconds on a GPU (CUDA, the model), held
under its handle's lock. The handler started it on the HTTP thread, so tenants sampling for the first time at
once could take every one of the service's ``http_threads`` for that long, and every other tenant's calls,
heartbeats too, waited. Here the service has ONE HTTP thread and the sampler's start is held at a gate: another
call still answers, and once the gate opens the sample completes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types
from tinker_testlib import KEYS, serving_hf_models

from rota_tinker import TinkerService
from rota_tinker._http.handles import WorkerHandle
from rota_tinker.testing import hf_snapshot

HANG_GUARD_S = 120  # a hang, not a speed
QWEN = "acme/Qwen3-Tiny"


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[TinkerService]:
    hf_snapshot(tmp_path / "models" / "acme" / "Qwen3-Tiny", seed=2)
    with serving_hf_models([str(tmp_path / "models")], str(tmp_path / "data"), "tinker-start-off-thread",
                           http_threads=1, share_lora_base=False) as service:
        yield service


def test_a_sampler_starting_holds_no_http_thread(svc: TinkerService, monkeypatch: pytest.MonkeyPatch) -> None:
    gate, starting = threading.Event(), threading.Event()
    real = WorkerHandle._spawn

    def gated(self: WorkerHandle) -> Any:
        if self.spec.role == "sampler":
            starting.set()
            assert gate.wait(HANG_GUARD_S), "the test never opened the gate"
        return real(self)

    monkeypatch.setattr(WorkerHandle, "_spawn", gated)
    sc = tinker.ServiceClient(base_url=svc.url, api_key=KEYS["alice"])
    sampler = sc.create_sampling_client(base_model=QWEN).result(timeout=HANG_GUARD_S)
    pending = sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                             sampling_params=types.SamplingParams(max_tokens=3, seed=1))
    try:
        assert starting.wait(HANG_GUARD_S), "the sample never started its sampler"
        caps = httpx.get(f"{svc.url}/api/v1/get_server_capabilities", headers={"X-API-Key": KEYS["bob"]},
                         timeout=HANG_GUARD_S)  # the service's only HTTP thread must be free to answer
        assert caps.status_code == 200, caps.text
        handle = svc.state.workers[("alice", "sampler")]
        assert not handle.running  # still held at the gate: the answer did not wait for the start
    finally:
        gate.set()
    result = pending.result(timeout=HANG_GUARD_S)
    assert len(result.sequences) == 1 and len(result.sequences[0].tokens) == 3
