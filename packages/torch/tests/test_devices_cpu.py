"""What a move to another device asks of rota_torch, checked on the CPU (the moves themselves run in
tests/cuda/test_devices_cuda.py): a turn on the model's own device restores as before; a turn on a
device rota_torch cannot move to is refused naming it, and the state stays parked."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rota import ParkPlan
from rota_torch import DeviceMismatch, Tracked


def _job(gpu):
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    return model, opt, Tracked(gpu, model, opt)


def test_restore_on_its_own_device_is_a_plain_restore(torch_connect):
    gpu = torch_connect("a")
    model, _, tracked = _job(gpu)
    before = model.weight.detach().clone()
    tracked.park()
    tracked.restore(ParkPlan(device=""))
    assert torch.equal(model.weight, before) and model.weight.device.type == "cpu"


@pytest.mark.parametrize("device", ["fake:1", "cuda:0"])
def test_a_device_rota_torch_cannot_move_to_is_refused_and_stays_parked(torch_connect, device):
    gpu = torch_connect("a")
    model, _, tracked = _job(gpu)
    tracked.park()
    with pytest.raises(DeviceMismatch, match=f"granted on {device}.*only between CUDA devices"):
        tracked.restore(ParkPlan(device=device))
    assert tracked.parked
    tracked.restore()
    assert model.weight.untyped_storage().nbytes() > 0


def test_a_fake_device_cannot_be_tracked(endpoint):
    import rota
    from rota_torch.testing import untrack_models_of

    gpu = rota.connect(group="g", tenant="f", endpoint=endpoint, devices="fake:0,fake:1")
    try:
        assert gpu.device == "fake:0"
        with pytest.raises(DeviceMismatch, match=r"fake device fake:0.*name cuda:N in ROTA_DEVICES"):
            Tracked(gpu, nn.Linear(2, 2), None)
    finally:
        untrack_models_of([gpu])
        gpu.close()


def _shared_state():
    """A model with a buffer that views a weight's storage (two tracked tensors, one storage), AdamW state and
    grads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    model[1].register_buffer("rows", model[0].weight.data[2:4])  # a view: shares the weight's storage
    opt = torch.optim.AdamW(model.parameters())
    for i in range(2):
        opt.zero_grad(set_to_none=False)
        model(torch.randn(4, 8, generator=torch.Generator().manual_seed(i))).pow(2).mean().backward()
        opt.step()
    return model, opt


def _snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()], [p.grad.clone() for p in model.parameters()],
            [v.clone() for s in opt.state.values() for v in s.values()])


@pytest.mark.parametrize("parked", [False, True], ids=["resident", "parked"])
def test_a_move_re_points_every_tracked_tensor_and_keeps_identities_and_shared_storages(torch_connect, parked):
    """The re-pointing a move does, on the CPU (source and target the same device, so it runs here): new
    storages, the same Python tensors, a view still on its base's storage, values unchanged, and the step goes
    on."""
    from rota_torch._move import move_resident, rehome_parked

    gpu = torch_connect("a")
    model, opt = _shared_state()
    tracked = Tracked(gpu, model, opt)
    params, before = list(model.parameters()), _snapshot(model, opt)
    old = {p.untyped_storage()._cdata for p in params}
    if parked:
        tracked.park()
        rehome_parked(tracked.parker, torch.device("cpu"))
        tracked.parker.restore()
    else:
        move_resident(tracked.parker, torch.device("cpu"))
    assert list(model.parameters()) == params  # the same objects: the optimizer still holds them
    assert not old & {p.untyped_storage()._cdata for p in params}  # on new storages
    assert model[1].rows.untyped_storage()._cdata == model[0].weight.untyped_storage()._cdata  # still one storage
    assert torch.equal(model[1].rows, model[0].weight[2:4]) and model[1].rows.storage_offset() == 16
    for a, b in zip(_snapshot(model, opt), before, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    model(torch.ones(2, 8)).sum().backward()
    opt.step()  # optimizer state and grads are the ones it re-pointed
