"""The rota_torch engine directly: chunked pool, discard, overlap, unparkable storages."""

from __future__ import annotations

import pytest
import torch

from rota_torch import HostPool, TensorParker, overlap


def test_slots_spanning_pool_chunks_round_trip_and_checkpoint():
    pool = HostPool(pin=False, chunk_bytes=1024)  # every tensor below spans chunks
    parker = TensorParker("cpu", pool=pool)
    ts = {f"t{i}": torch.randn(300 + i) for i in range(5)}
    view = ts["t4"][10:50]
    want = {k: v.clone() for k, v in ts.items()}
    parker.add("weights", ts)
    parker.reserve()
    assert len(pool.chunks) > 1 and pool.allocations == 1
    parker.park()
    assert all(t.untyped_storage().nbytes() == 0 for t in ts.values())
    assert torch.equal(parker.host_tensor(view), want["t4"][10:50])
    assert all(torch.equal(parker.host_tensor(t), want[k]) for k, t in ts.items())
    parker.restore()
    assert all(torch.equal(t, want[k]) for k, t in ts.items())
    assert pool.allocations == 1


def test_discarded_tag_is_not_copied_and_comes_back_zero():
    parker = TensorParker("cpu")
    w, g = torch.randn(64), torch.randn(64)
    parker.add("weights", [w])
    parker.add("grads", [g])
    result = parker.park(discard=("grads",))
    assert result.by_tag == {"weights": 256, "grads": 0} and result.bytes_moved == 256
    assert g.untyped_storage().nbytes() == 0
    parker.restore()
    assert torch.count_nonzero(g) == 0 and torch.count_nonzero(w) > 0


def test_tag_added_first_owns_a_shared_storage():
    parker = TensorParker("cpu")
    base = torch.randn(32)
    parker.add("weights", [base[:16]])
    parker.add("grads", [base[16:]])
    assert parker.footprint() == {"weights": 128, "grads": 0}
    parker.park(discard=("grads",))  # grads own nothing: the shared storage is copied as weights
    parker.restore()
    assert torch.count_nonzero(base) == 32


def test_overlap_parks_one_while_restoring_the_other():
    a_t, b_t = [torch.randn(100) for _ in range(3)], [torch.randn(50) for _ in range(3)]
    want_a, want_b = [t.clone() for t in a_t], [t.clone() for t in b_t]
    a, b = TensorParker("cpu", name="a"), TensorParker("cpu", name="b")
    a.add("weights", a_t)
    b.add("weights", b_t)
    b.park()
    out, into = overlap(park=a, restore=b)
    assert a.parked and not b.parked
    assert out.bytes_moved == 1200 and into.bytes_moved == 600
    assert all(torch.equal(t, w) for t, w in zip(b_t, want_b, strict=True))
    overlap(park=b, restore=a)
    assert all(torch.equal(t, w) for t, w in zip(a_t, want_a, strict=True))
    with pytest.raises(ValueError, match="twice"):
        overlap(park=a, restore=a)


def test_unresizable_storage_is_refused_before_anything_is_freed():
    import numpy as np

    parker = TensorParker("cpu")
    ok, fixed = torch.randn(8), torch.from_numpy(np.ones(8, dtype=np.float32))
    parker.add("weights", {"ok": ok, "fixed": fixed})
    with pytest.raises(RuntimeError, match=r"'fixed'.*cannot be resized"):
        parker.park()
    assert ok.untyped_storage().nbytes() == 32 and not parker.parked


def test_core_imports_without_torch():
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; "
            "import rota, rota.hookspecs, rota.testing, rota.residue, rota.nvml, rota.cli.main; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr
