"""A demo worker's end on a shared device, against a real orchestrator: its vLLM engine is put to sleep through
rota, so a park the orchestrator asks for afterwards moves nothing, and whatever a park did as the run ended is in
the worker's report.

On an H100 at 6ca51d2 the h100 shapes' run logged ``park of rl-b-sampler failed`` (CUDA error: invalid argument)
and still reported 0 failed parks: the worker had put its engine to sleep with ``LLM.sleep(level=2)`` behind
rota_vllm's back, the orchestrator then asked for a park, which copied weights from unmapped memory, and the
report had been read before that park ended. The engine below is a fake of ``vllm.LLM`` (no vLLM on this machine)
whose save of sleeping weights fails as that copy did."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch", reason="the demo's workers need torch (installed by ./dev setup)")
rota_vllm = pytest.importorskip("rota_vllm", reason="needs rota-adapter-vllm (installed by ./dev setup)")

from rota_demo.llm_worker import LlmWork  # noqa: E402
from rota_demo.worker import DeviceTurns, WorkerReport, WorkerSpec  # noqa: E402


class FreeingLLM:
    """``vllm.LLM``'s sleep mode over one in-process worker: asleep, its weights' memory is unmapped, so a worker call
    that reads them (rota_vllm's save) fails as it did on the H100."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.worker = SimpleNamespace(model_runner=SimpleNamespace(model=torch.nn.Linear(16, 16)))
        self.asleep: set[str] = set()

    def sleep(self, level: int = 1) -> None:
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.asleep -= set(tags or self.asleep)

    def collective_rpc(self, method: Any, args: tuple = (), kwargs: dict | None = None) -> list[Any]:
        if "weights" in self.asleep and method.__name__ == "worker_save":
            raise RuntimeError("CUDA error: invalid argument (fake: the weights' memory is unmapped)")
        return [method(self.worker, *args, **(kwargs or {}))]


@pytest.fixture
def engine_worker(endpoint: str) -> Iterator[tuple[DeviceTurns, LlmWork, FreeingLLM]]:
    """A demo engine worker at its run's end; untracked after the test (rota's host pool for the engine's weights
    stays in this process otherwise, and the node-ledger tests that run later in it count it)."""
    dev, work, llm = _engine_worker(endpoint)
    yield dev, work, llm
    work.engine.tracked.untrack()


def _engine_worker(endpoint: str) -> tuple[DeviceTurns, LlmWork, FreeingLLM]:
    spec = WorkerSpec(job="rl-b", kind="rl", role="sampler", steps=1, seed=0, size=None, device="cpu", group="g",
                      endpoint=endpoint, engine="vllm", footprint_hint=1 << 20)
    dev = DeviceTurns(spec, WorkerReport(spec.name, group="g"))
    llm = FreeingLLM()
    work = LlmWork(spec)
    work.engine = SimpleNamespace(llm=llm, tracked=rota_vllm.track(dev.gpu, llm, check_version=False))
    with dev.phase():  # one turn of the engine, as a run's last rollout
        pass
    dev.started()
    return dev, work, llm


def test_the_engine_is_freed_through_rota_so_a_later_park_moves_nothing(engine_worker: Any) -> None:
    dev, work, llm = engine_worker
    dev.report.end = time.monotonic()  # as the worker's loop ends
    work.free(None, None, dev)
    assert llm.asleep == {"weights", "kv_cache"} and work.engine.tracked.parked_level == 2
    dev.gpu.park()  # what the orchestrator's park command runs: the state is parked already
    dev.close()
    assert dev.report.failures == [], dev.report.failures
    assert dev.report.parks == [] and dev.report.events == []  # the clean-up's park is not one of the run's


def test_a_park_that_fails_as_the_run_ends_is_in_the_report(engine_worker: Any) -> None:
    """What the demo did before: the engine asleep behind rota_vllm's back, then the orchestrator's park."""
    dev, _, llm = engine_worker
    llm.sleep(level=2)
    with pytest.raises(RuntimeError):
        dev.gpu.park()
    dev.close()
    assert [kind for kind, _ in dev.report.failures] == ["park"], dev.report.failures
