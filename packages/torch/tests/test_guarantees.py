"""Switch guarantees of rota_torch in one process: checked restores, deadlines, room, staging, budgets."""

from __future__ import annotations

import time

import pytest
import torch

from rota.errors import ConfigError
from rota_torch import (
    DiscardedTag,
    HostBudgetExceeded,
    HostPool,
    NoRoom,
    SwitchTimeout,
    TensorParker,
    VerifyError,
)


def _parker(verify: str = "sample", **kw: object) -> tuple[TensorParker, torch.Tensor, torch.Tensor]:
    parker = TensorParker("cpu", pool=HostPool(pin=False), verify=verify, **kw)
    w, g = torch.randn(4096), torch.randn(64)
    parker.add("weights", {"w": w})
    parker.add("grads", {"g": g})
    return parker, w, g


@pytest.mark.parametrize("verify", ["sample", "full"])
def test_corrupted_host_copy_is_refused_and_the_parker_stays_parked(verify):
    parker, w, _ = _parker(verify)
    want = w.clone()
    parker.park()
    slot = next(sl for sl in parker._slots.values() if sl.tag == "weights")
    parker.pool.view(slot.offset, slot.nbytes).zero_()
    with pytest.raises(VerifyError, match="'w' \\(tag 'weights'"):
        parker.restore()
    assert parker.parked and w.untyped_storage().nbytes() == 0  # rolled back, nothing left allocated
    parker.pool.view(slot.offset, slot.nbytes).copy_(want.view(torch.uint8))  # host copy repaired
    parker.restore()
    assert torch.equal(w, want)


@pytest.mark.parametrize("window", ["first", "middle", "last"])
def test_sampled_windows_of_every_region_are_checked_across_pool_chunks(window):
    """Regions small and large, one spanning two pool chunks: a byte changed in any sampled window is named."""
    from rota_torch._guard import SAMPLES, WINDOW, sample_index

    parker = TensorParker("cpu", pool=HostPool(pin=False, chunk_bytes=1 << 16), verify="sample")
    tensors = {"small": torch.randn(25), "big": torch.randn(30_000), "bigger": torch.randn(50_000)}
    want = {k: v.clone() for k, v in tensors.items()}
    parker.add("weights", tensors)
    parker.park()
    slots = sorted(parker._slots.values(), key=lambda sl: sl.offset)
    positions, regions = sample_index([sl.offset for sl in slots], [sl.nbytes for sl in slots])
    assert torch.equal(positions, positions.sort().values)  # sorted: one read per pool chunk
    counts = torch.bincount(regions).tolist()
    assert counts == [13, SAMPLES * WINDOW // 8, SAMPLES * WINDOW // 8]  # a small region is read whole (100 B)
    assert len(parker.pool.chunks) > 1 and any(len(parker.pool.pieces(sl.offset, sl.nbytes)) > 1 for sl in slots)
    for i, sl in enumerate(slots):
        mine = positions[regions == i]
        assert int(mine.min()) == sl.offset // 8 and int(mine.max()) == (sl.offset + sl.nbytes - 1) // 8
    target = next(sl for sl in slots if sl.name == "bigger")
    offset = {"first": 0, "middle": 7 * (target.nbytes - WINDOW) // (SAMPLES - 1) + 5,
              "last": target.nbytes - 1}[window]
    byte = parker.pool.view(target.offset + offset, 1)
    byte.copy_(byte ^ 0xFF)
    with pytest.raises(VerifyError, match="'bigger'"):
        parker.restore()
    byte.copy_(byte ^ 0xFF)
    parker.restore()  # untouched again: the same windows now match
    assert all(torch.equal(tensors[k], want[k]) for k in tensors)


def test_pool_chunk_size_must_be_aligned():
    with pytest.raises(ConfigError, match="chunk_bytes=1000 must be a positive multiple of 512"):
        HostPool(pin=False, chunk_bytes=1000)


def test_verify_off_lets_corruption_through():
    parker, w, _ = _parker("off")
    parker.park()
    parker.pool.chunks[0].zero_()
    parker.restore()
    assert torch.count_nonzero(w) == 0


def test_bad_verify_mode_names_the_value(monkeypatch):
    with pytest.raises(ConfigError, match=r"'fast'.*off, sample, full"):
        TensorParker("cpu", verify="fast")
    monkeypatch.setenv("ROTA_VERIFY", "always")
    with pytest.raises(ConfigError, match="ROTA_VERIFY='always'"):
        TensorParker("cpu")


def test_discarded_tags_are_never_presented_as_restored():
    parker = TensorParker("cpu", pool=HostPool(pin=False))
    w, g, kv = torch.randn(64), torch.randn(64), torch.randn(64)
    rebuilt = []
    parker.add("weights", [w], on_discard="error")
    parker.add("grads", [g])  # zeros
    parker.add("kv_cache", [kv], on_discard=lambda: rebuilt.append(kv.fill_(7.0)))
    parker.park(discard=("grads", "kv_cache"))
    result = parker.restore()
    assert result.discarded == ["grads"] and result.recreated == ["kv_cache"]
    assert "grads" not in result.by_tag and "kv_cache" not in result.by_tag and result.by_tag["weights"] == 256
    assert torch.count_nonzero(g) == 0 and rebuilt and torch.all(kv == 7.0)
    parker.park(discard=("weights",))
    with pytest.raises(DiscardedTag, match="\\['weights'\\]"):
        parker.restore()
    assert parker.parked


def test_park_past_its_deadline_frees_nothing():
    parker, w, _ = _parker(deadline_s=0.05)
    parker.add("weights", lambda: (time.sleep(0.2), [])[1])
    with pytest.raises(SwitchTimeout, match=r"deadline.*rolled back"):
        parker.park()
    assert not parker.parked and w.untyped_storage().nbytes() == 4096 * 4


def test_restore_without_room_allocates_nothing(monkeypatch):
    monkeypatch.setenv("ROTA_RESTORE_ROOM_WAIT_S", "0.1")
    free = [100]
    parker, w, g = _parker(free_bytes=lambda device: free[0])
    parker.park()
    with pytest.raises(NoRoom, match=r"restore needs.*after waiting 0.1 s \(ROTA_RESTORE_ROOM_WAIT_S\)"):
        parker.restore()
    assert parker.parked and w.untyped_storage().nbytes() == 0 and g.untyped_storage().nbytes() == 0
    free[0] = 1 << 30
    parker.restore()
    assert not parker.parked


def test_restore_waits_for_memory_another_process_is_giving_back():
    """A tenant that just ended frees its device memory a moment after the orchestrator knows: the next
    restore, granted in that moment, waits for the room instead of failing the turn."""
    reads = []

    def free_bytes(device):  # the fake driver: room appears at the fourth reading
        reads.append(device)
        return 100 if len(reads) < 4 else 1 << 30

    parker, w, _ = _parker(free_bytes=free_bytes)
    parker.park()
    parker.restore()
    assert not parker.parked and w.untyped_storage().nbytes() == 4096 * 4 and len(reads) == 4


def test_restore_is_staged_weights_and_optimizer_before_caches(monkeypatch):
    parker = TensorParker("cpu", pool=HostPool(pin=False))
    for tag in ("kv_cache", "grads", "optimizer", "weights"):
        parker.add(tag, [torch.randn(8)])
    parker.park()
    order = []
    real = TensorParker._copy_in
    monkeypatch.setattr(TensorParker, "_copy_in", lambda self, sl, **kw: (order.append(sl.tag), real(self, sl, **kw)))
    parker.restore()
    assert order == ["weights", "optimizer", "grads", "kv_cache"]


def test_host_budget_refuses_without_spill_dir_and_spills_with_one(tmp_path):
    with pytest.raises(HostBudgetExceeded, match=r"ROTA_HOST_BUDGET_BYTES.*ROTA_SPILL_DIR"):
        HostPool(pin=False, budget_bytes=1024, spill_dir="").reserve(1 << 20)
    pool = HostPool(pin=False, budget_bytes=1024, spill_dir=str(tmp_path), chunk_bytes=1 << 16)
    parker = TensorParker("cpu", pool=pool)
    w = torch.randn(1 << 16)
    want = w.clone()
    parker.add("weights", [w])
    result = parker.park()
    assert result.spilled_bytes >= w.nbytes and result.host_bytes >= w.nbytes
    parker.restore()
    assert torch.equal(w, want)


def test_bad_budget_and_spill_dir_name_the_value(monkeypatch, tmp_path):
    monkeypatch.setenv("ROTA_HOST_BUDGET_BYTES", "lots")
    with pytest.raises(ConfigError, match="ROTA_HOST_BUDGET_BYTES='lots'"):
        HostPool(pin=False)
    monkeypatch.setenv("ROTA_HOST_BUDGET_BYTES", "12GB")  # the units of --capacity and every other size
    assert HostPool(pin=False).budget_bytes == 12 * 10**9
    monkeypatch.delenv("ROTA_HOST_BUDGET_BYTES")
    monkeypatch.setenv("ROTA_SPILL_DIR", str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match=r"ROTA_SPILL_DIR=.*not a directory"):
        HostPool(pin=False)


def test_residue_fault_names_tensors_and_reports_memory_outside_the_allocator_uncounted():
    """The message a user sees after a park that left 2 GiB: who holds it, and NCCL's share apart."""
    from rota import ParkResult
    from rota.residue import residue_fault

    result = ParkResult(residue={
        "untracked:FSDPCommContext.reduce_scatter_state.reduce_scatter_input (float32[553648128])": 2112 << 20,
        "process:allocated": 2200 << 20, "process:reserved": 2300 << 20,
        "process:outside_allocator": 900 << 20, "process:outside_allocator_growth": 380 << 20})
    message = residue_fault(result, 256 << 20)
    assert "park left 2200.0 MiB" in message  # the allocator's total, not the sum with NCCL's bytes
    assert "FSDPCommContext.reduce_scatter_state.reduce_scatter_input" in message
    assert "outside torch's allocator (not counted): 900.0 MiB, 380.0 MiB of it since the tenant was tracked" \
        in message
    within = ParkResult(residue={"process:allocated": 100 << 20, "process:outside_allocator": 5 << 30})
    assert residue_fault(within, 256 << 20) == ""  # NCCL and the context never make a fault


def test_a_restore_copies_each_batch_before_it_allocates_the_next(monkeypatch):
    """The plain restore is pipelined (on a GPU the first copies run while the rest is allocated): storages come
    back in batches of ``RESTORE_BATCH`` bytes, each allocated then copied, small storages allocated first, and the
    bytes and the stage order are those of an unpipelined restore."""
    import rota_torch._parker as parker_mod

    monkeypatch.setattr(parker_mod, "RESTORE_BATCH", 3 << 20)
    monkeypatch.setattr(parker_mod, "LARGE_ALLOC", 1 << 12)  # the CUDA allocator's large pool, scaled down
    parker = TensorParker("cpu", pool=HostPool(pin=False), verify="sample")
    big = {f"w{i}": torch.randn(1 << 18) for i in range(6)}  # 1 MiB each: two batches of three
    small = {"bias": torch.randn(16)}
    parker.add("weights", {**big, **small})
    parker.add("grads", [torch.randn(1 << 18)])
    want = {k: v.clone() for k, v in {**big, **small}.items()}
    parker.park()
    events: list[tuple[str, str]] = []
    real_alloc, real_copy = TensorParker._allocate, TensorParker._copy_in

    def allocate(slots):
        events.extend(("alloc", sl.name) for sl in slots if sl.storage.nbytes() != sl.nbytes)
        return real_alloc(slots)

    monkeypatch.setattr(TensorParker, "_allocate", staticmethod(allocate))
    monkeypatch.setattr(TensorParker, "_copy_in",
                        lambda self, sl, **kw: (events.append(("copy", sl.name)), real_copy(self, sl, **kw)))
    parker.restore()
    assert all(torch.equal(v, want[k]) for k, v in {**big, **small}.items())
    assert events[0] == ("alloc", "bias")  # small first
    names = [f"w{i}" for i in range(6)]
    assert events[1:] == [*[("alloc", n) for n in names[:3]], ("copy", "w0"), ("copy", "w1"), ("copy", "w2"),
                          *[("alloc", n) for n in names[3:]], ("copy", "w3"), ("copy", "w4"), ("copy", "w5"),
                          ("alloc", "0"), ("copy", "bias"), ("copy", "0")]  # the bias, allocated already
    assert set(parker.last_phases) >= {"check", "allocate_issue", "check_host", "wait", "finish"}
