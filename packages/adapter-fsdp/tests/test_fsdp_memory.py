"""Park really frees device storages, and the host pool is allocated once and reused."""

from __future__ import annotations

import torch
from fsdp_testlib import make_model, make_optimizer, train_step

import rota_fsdp


def _state_tensors(model, opt):
    ts = list(model.parameters()) + list(model.buffers()) + [p.grad for p in model.parameters()]
    ts += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return ts


def test_park_frees_every_storage_and_restore_keeps_identities(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt)
    with gpu.turn():
        train_step(model, opt, 0)
    before = _state_tensors(model, opt)
    ids = [id(t) for t in before]
    values = [t.clone() for t in before]
    resident = tracked.footprint()
    assert resident["weights"] > 0 and resident["grads"] > 0 and resident["optimizer"] > 0
    gpu.park()
    assert all(t.untyped_storage().nbytes() == 0 for t in before)
    assert tracked.parker.device_bytes() == {"weights": 0, "optimizer": 0, "grads": 0}
    assert tracked.footprint() == resident  # what the tenant needs back, also while parked
    assert gpu.footprint() == resident
    with gpu.turn():
        after = _state_tensors(model, opt)
        assert [id(t) for t in after] == ids
        assert all(torch.equal(a, v) for a, v in zip(after, values, strict=True))


def test_pool_allocations_do_not_grow_over_50_cycles(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt)
    with gpu.turn():
        train_step(model, opt, 0)
    gpu.park()
    pool = tracked.parker.pool
    allocations, capacity, buffer = pool.allocations, pool.capacity, [c.data_ptr() for c in pool.chunks]
    assert allocations == 1  # the estimate at track() already covered AdamW's lazily created state
    for i in range(1, 51):
        with gpu.turn():
            train_step(model, opt, i)
        gpu.park()
    assert pool.allocations == allocations
    assert pool.capacity == capacity and [c.data_ptr() for c in pool.chunks] == buffer


def test_pool_grows_only_when_tracked_state_grows(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # state not estimated ahead
    tracked = rota_fsdp.track(gpu, model, opt, tags=("weights", "optimizer"))
    tracked.prepare()
    pool = tracked.parker.pool
    first = pool.allocations
    gpu.park()
    assert pool.allocations == first
    with gpu.turn():
        train_step(model, opt, 0)  # creates momentum buffers: more bytes to park
    gpu.park()
    assert pool.allocations == first + 1
    for i in range(1, 6):
        with gpu.turn():
            train_step(model, opt, i)
        gpu.park()
    assert pool.allocations == first + 1


def test_shared_storages_are_copied_once_and_freed_once(torch_connect):
    gpu = torch_connect("trainer")
    model = torch.nn.Linear(4, 4)
    flat = torch.zeros(4 * 4 + 4)  # one storage behind both parameters, like FSDP's flat buffers
    flat[:16].copy_(model.weight.detach().reshape(-1))
    flat[16:].copy_(model.bias.detach())
    model.weight = torch.nn.Parameter(flat[:16].view(4, 4))
    model.bias = torch.nn.Parameter(flat[16:])
    want = flat.clone()
    nbytes = flat.untyped_storage().nbytes()
    tracked = rota_fsdp.track(gpu, model, tags=("weights",))
    result = gpu.park()
    assert result.bytes_moved == nbytes
    assert len(tracked.parker._slots) == 1
    with gpu.turn():
        assert torch.equal(flat, want)
        assert torch.equal(model.weight.detach().reshape(-1), want[:16])
