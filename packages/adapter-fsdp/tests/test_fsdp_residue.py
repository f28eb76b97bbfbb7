"""What a park leaves behind is named: untracked tensors by who holds them, on the way to a fault.

On the CPU the allocator has no totals, so the adapter's naming step is driven directly
with the residue a CUDA park reports (``process:allocated`` far above the named bytes);
the objects, the tensors and the walk over them are real.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from fsdp_testlib import make_model, make_optimizer, train_step

import rota_fsdp


class Kept(NamedTuple):
    buf: torch.Tensor
    event: object


class CommContext:
    """Holds a buffer the way FSDP2's comm context holds a reduce-scatter input."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.reduce_scatter_state = Kept(buf, None)


def test_unexplained_allocator_bytes_are_named_by_holder(torch_connect):
    gpu = torch_connect("t")
    model, opt = make_model(), None
    opt = make_optimizer(model)
    train_step(model, opt, 0)
    tracked = rota_fsdp.track(gpu, model, opt)
    leak = CommContext(torch.empty(300 << 20, dtype=torch.uint8))  # the largest CPU tensor of the process
    model[0].cache = torch.empty(200 << 20, dtype=torch.uint8)  # a module attribute: named by its path
    residue = tracked.untracked_residue()  # what every park reports first
    assert residue == {"untracked:0.cache": 200 << 20}
    residue.update(tracked._unexplained_residue({**residue, "process:allocated": 1 << 40}))
    names = {k: v for k, v in residue.items() if v >= 200 << 20}
    assert names == {"untracked:CommContext.reduce_scatter_state.buf (uint8[314572800])": 300 << 20,
                     "untracked:0.cache": 200 << 20}  # the module attribute once, not twice
    tracked_keys = {k for k in tracked.parker.storages()}
    assert not any(str(k) in name for k in tracked_keys for name in residue)  # tracked state is never named
    del leak, model[0].cache


def test_small_unexplained_residue_is_not_walked(torch_connect):
    tracked = rota_fsdp.track(torch_connect("t"), make_model(), None)
    assert tracked._unexplained_residue({"process:allocated": 64 << 20}) == {}
