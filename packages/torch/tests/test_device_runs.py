"""A copy run never crosses from one driver allocation into the next (rota_torch._copies.device_runs).

Why: two ``cudaMalloc`` segments can lie back to back in the address space; one ``cudaMemcpyAsync`` across
both fails with "invalid argument", and on the H200 at 49a8a30 every park of a TRL job after its first failed
so. Which addresses belong to which allocation is the driver's to say (``cuPointerGetAttribute``); here a
table of fake allocations (named a fake: no CUDA driver on this machine) stands in for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from rota_torch._copies import Slot, allocation_range, device_runs
from rota_torch._pool import align

N = align(4096)  # a size the pool's alignment leaves as it is: no padding between back-to-back storages


@dataclass
class FakeStorage:
    """A storage at a device address (the only thing device_runs reads of it)."""

    ptr: int

    def data_ptr(self) -> int:
        return self.ptr


def slots_at(*ptrs: int) -> list[Slot]:
    """Slots back to back in the pool, at the given device addresses."""
    return [Slot(FakeStorage(p), N, "weights", i * N, f"t{i}") for i, p in enumerate(ptrs)]  # type: ignore[arg-type]


def fake_driver(*allocations: tuple[int, int]):
    """allocation_range over (start, size) allocations; None outside all of them. Counts its calls."""
    def range_of(ptr: int) -> tuple[int, int] | None:
        range_of.calls += 1
        return next(((s, n) for s, n in allocations if s <= ptr < s + n), None)
    range_of.calls = 0
    return range_of


def names(runs: list[list[Slot]]) -> list[list[str]]:
    return [[sl.name for sl in run] for run in runs]


def test_storages_back_to_back_in_one_allocation_are_one_run_and_the_driver_is_asked_once() -> None:
    base = 1 << 40
    slots = slots_at(base, base + N, base + 2 * N)
    driver = fake_driver((base, 3 * N))
    assert names(device_runs(slots, driver)) == [["t0", "t1", "t2"]]
    assert driver.calls == 1  # once per run, not once per storage (a park walks hundreds)


def test_a_run_stops_where_the_next_allocation_begins_even_when_the_addresses_continue() -> None:
    base = 1 << 40
    slots = slots_at(base, base + N, base + 2 * N, base + 3 * N)
    driver = fake_driver((base, 2 * N), (base + 2 * N, 2 * N))  # two segments, the second right after the first
    assert names(device_runs(slots, driver)) == [["t0", "t1"], ["t2", "t3"]]


def test_nothing_merges_where_the_driver_cannot_say() -> None:
    base = 1 << 40
    slots = slots_at(base, base + N)
    assert names(device_runs(slots, lambda ptr: None)) == [["t0"], ["t1"]]


def test_storages_apart_on_the_device_are_separate_runs() -> None:
    base = 1 << 40
    slots = slots_at(base, base + 4 * N)
    assert names(device_runs(slots, fake_driver((base, 8 * N)))) == [["t0"], ["t1"]]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tier checks the real lookup "
                    "(tests/cuda/test_torch_park_cuda.py)")
def test_without_a_cuda_driver_the_real_lookup_says_nothing() -> None:
    assert allocation_range(1 << 40) is None
