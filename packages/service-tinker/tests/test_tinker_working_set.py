"""A tenant's ``working`` footprint (:class:`rota_torch.WorkingSet`: its last turn's peak allocator cache beyond
its tracked tensors, which the Tinker workers and the demo's workers report on CUDA) reaches the orchestrator and
decides what ``capacity_bytes`` keeps resident.

The allocator's peak is a fake here (no GPU on this machine: on CUDA it is ``torch.cuda.max_memory_reserved``);
the tenants, their tracked models, the orchestrator and its residency decisions are real.
"""

from __future__ import annotations

import torch

import rota
import rota_fsdp
from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator
from rota_torch import WorkingSet
from rota_torch.testing import untrack_models_of

MIB = 2**20


class FakeAllocatorPeak:
    """Stands in for torch.cuda's peak: ``extra`` bytes above whatever the tenant tracks."""

    def __init__(self, gpu: rota.Gpu, extra: int) -> None:
        self.gpu, self.extra, self.resets = gpu, extra, 0

    def peak(self) -> int:
        return sum(v for k, v in self.gpu.footprint().items() if k != "working") + self.extra

    def reset(self) -> None:
        self.resets += 1


def turn(gpu: rota.Gpu, working: WorkingSet) -> None:
    """One turn as the worker's loop runs it: acquire (rota_turn_started restarts the peak), measure the turn,
    release."""
    gpu.acquire()
    working.turn_ended()
    gpu.release()


def test_working_set_is_reported_and_counted_against_capacity() -> None:
    with running_orchestrator(OrchestratorConfig(capacity_bytes=3 * MIB, ttl_s=10.0)) as (endpoint, _engine):
        gpus, sets, fakes = [], [], []
        for name in ("a", "b"):
            gpu = rota.connect(group="ws", tenant=name, endpoint=endpoint)
            model = torch.nn.Linear(64, 64)
            rota_fsdp.track(gpu, model, torch.optim.SGD(model.parameters(), lr=0.1), device="cpu")
            fake = FakeAllocatorPeak(gpu, 2 * MIB)
            gpus.append(gpu)
            fakes.append(fake)
            sets.append(WorkingSet(gpu, "cpu", peak=fake.peak, reset=fake.reset))
        a, b = gpus
        try:
            assert a.footprint()["working"] == 0  # nothing measured before a first turn
            turn(a, sets[0])
            assert a.footprint()["working"] == 2 * MIB and fakes[0].resets == 1  # its own turn's hook only
            assert sets[0].turn_ended() == a.footprint()  # it returns the footprint it now reports: no second read
            assert fakes[1].resets == 0
            turn(b, sets[1])  # b's working set is not known yet: it fits beside a, a stays resident
            assert len(a.stats.parks) == 0
            turn(a, sets[0])  # now both are known: 2 x (2 MiB + tracked) > 3 MiB, so b is parked for a
            assert len(b.stats.parks) == 1 and b.parked
            assert len(a.stats.parks) == 0
        finally:
            untrack_models_of(gpus)  # their host pools go with them
            for gpu in gpus:
                gpu.close()


def test_a_failing_measurement_keeps_the_last_value_and_the_worker() -> None:
    with running_orchestrator() as (endpoint, _engine):
        gpu = rota.connect(group="ws", tenant="a", endpoint=endpoint)
        values = iter([5 * MIB])

        def peak() -> int:
            return next(values)  # the second read raises StopIteration, as a CUDA error would raise

        def reset() -> None:
            raise RuntimeError("Invalid device argument")  # what torch.cuda raises before CUDA is used

        working = WorkingSet(gpu, "cpu", peak=peak, reset=reset)
        try:
            turn(gpu, working)
            assert gpu.footprint()["working"] == 5 * MIB
            turn(gpu, working)
            assert gpu.footprint()["working"] == 5 * MIB
            assert working.turn_ended() is None  # a failed measurement returns nothing to record
        finally:
            gpu.close()
