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
