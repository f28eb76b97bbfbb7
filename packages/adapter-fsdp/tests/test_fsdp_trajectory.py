"""Parking and restoring a tenant every step loses nothing: losses and params bit-identical."""

from __future__ import annotations

import pytest
import torch
from fsdp_testlib import make_model, make_optimizer, snapshot, train_step

import rota_fsdp

STEPS = 20


def reference(steps: int = STEPS) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = make_model()
    opt = make_optimizer(model)
    losses = [train_step(model, opt, i) for i in range(steps)]
    return losses, snapshot(model, opt)


@pytest.mark.parametrize("discard", [(), ("grads",)])
def test_parked_every_step_is_bit_identical(torch_connect, discard):
    ref_losses, ref_state = reference()
    gpu = torch_connect("trainer")
    model = make_model()
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt, discard=discard)
    losses = []
    for i in range(STEPS):
        with gpu.turn():
            losses.append(train_step(model, opt, i))
        result = gpu.park()
        assert gpu.parked and tracked.parked
        assert result.bytes_moved > 0
        assert all(t.untyped_storage().nbytes() == 0 for t in model.parameters())
        if i > 0:  # optimizer state exists from the first step on and is parked too
            assert all(v.untyped_storage().nbytes() == 0 for s in opt.state.values() for v in s.values()
                       if isinstance(v, torch.Tensor))
    with gpu.turn():
        state = snapshot(model, opt)
    assert len(gpu.stats.parks) == STEPS and len(gpu.stats.restores) == STEPS
    assert len(losses) == len(ref_losses)
    for got, want in zip(losses, ref_losses, strict=True):
        assert torch.equal(got, want)
    assert state.keys() == ref_state.keys()
    for name in ref_state:
        assert torch.equal(state[name], ref_state[name]), name


def test_a_changed_byte_would_be_seen(torch_connect):
    """The comparison above can fail: one flipped value while parked changes the trajectory."""
    ref_losses, _ = reference(5)
    gpu = torch_connect("trainer")
    model = make_model()
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt, verify="off")  # unchecked: the corruption reaches training
    losses = []
    for i in range(5):
        with gpu.turn():
            losses.append(train_step(model, opt, i))
        gpu.park()
        if i == 2:  # corrupt the host copy of the first weight
            slot = tracked.parker._slots[next(model.parameters()).untyped_storage()._cdata]
            tracked.parker.pool.view(slot.offset, 4).add_(1)
    assert torch.equal(losses[2], ref_losses[2])
    assert not torch.equal(losses[4], ref_losses[4])


def test_discarded_grads_come_back_zero_filled(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    opt = make_optimizer(model)
    rota_fsdp.track(gpu, model, opt, discard=("grads",))
    with gpu.turn():
        train_step(model, opt, 0)
    grads = [p.grad for p in model.parameters()]
    result = gpu.park()
    assert result.by_tag["grads"] == 0 and result.by_tag["weights"] > 0
    assert all(g.untyped_storage().nbytes() == 0 for g in grads)
    with gpu.turn():
        assert all(p.grad is g for p, g in zip(model.parameters(), grads, strict=True))
        assert all(torch.count_nonzero(g) == 0 for g in grads)
