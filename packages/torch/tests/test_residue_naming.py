"""Residue naming of the engine: live tensors by who holds them, memory outside the allocator."""

from __future__ import annotations

import torch

from rota_torch import name_untracked, outside_allocator_bytes


class Holder:
    """Keeps a tensor as an attribute, the way a framework keeps a communication buffer."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.kept = buf


def test_naming_skips_what_is_tracked_and_summarises_the_rest():
    a, b = torch.empty(150 << 20, dtype=torch.uint8), torch.empty(140 << 20, dtype=torch.uint8)
    small = torch.empty(1 << 10, dtype=torch.uint8)  # at least one tensor beyond limit=1, whatever else lives
    holder = Holder(a)
    out = name_untracked("cpu", {a.untyped_storage()._cdata}, limit=1)
    first = next(iter(out))
    assert "Holder.kept" not in first and first.endswith("(uint8[146800640])")
    assert any(k.startswith("untracked:(") and k.endswith("more tensors)") for k in out)
    del holder, b, small


def test_outside_allocator_is_unknown_off_cuda():
    assert outside_allocator_bytes("cpu") is None


def test_a_flat_buffer_is_reported_once_by_its_owner_not_by_a_view():
    """Weights that are views of one flat buffer (a shared base, a packed model) are one storage: reported once,
    with the buffer's own dtype and size, not as the first view the walk met (an Embedding weight of 13 GB)."""
    flat = torch.zeros(3 << 20, dtype=torch.uint8)
    emb = torch.nn.Embedding(64, 128)
    emb._parameters["weight"] = torch.nn.Parameter(flat[: 64 * 128 * 4].view(torch.float32).view(64, 128),
                                                   requires_grad=False)
    out = name_untracked("cpu", set(), limit=64)
    mine = {k: v for k, v in out.items() if k.endswith(f"(uint8[{3 << 20}])")}
    assert list(mine.values()) == [3 << 20], out
    assert "Embedding._parameters['weight'] (a view; 2 tensors share this buffer)" in next(iter(mine))
    holder = Holder(flat)
    out = name_untracked("cpu", set(), limit=64)
    assert out.get(f"untracked:Holder.kept (uint8[{3 << 20}])") == 3 << 20, out
    del holder, emb


class Cycle:
    """Garbage that only the cycle collector frees (a deleted FSDP2 model's modules and hooks are such)."""

    def __init__(self) -> None:
        self.me = self


def test_the_collector_runs_only_when_unnamed_bytes_would_fail_the_park():
    import gc
    import weakref

    from rota_torch import collect_if_over

    gc.disable()
    try:
        c = Cycle()
        ref = weakref.ref(c)
        del c  # alive in its cycle; say the allocator holds 1000 bytes for it
        assert not collect_if_over(1000, named=0, limit=2000) and ref() is not None  # within the limit
        assert not collect_if_over(1000, named=1000, limit=500) and ref() is not None  # all of it named: residue
        assert not collect_if_over(1000, named=0, limit=0) and ref() is not None  # the check is off
        assert collect_if_over(1000, named=0, limit=500) and ref() is None  # over, unnamed: collected
    finally:
        gc.enable()
