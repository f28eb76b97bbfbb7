"""A parked tenant's checkpoint is written from the host copy, without a device or a turn."""

from __future__ import annotations

import pytest
import torch
from fsdp_testlib import make_model, make_optimizer, train_step

import rota_fsdp
from rota_torch import VerifyError


def test_checkpoint_from_parked_equals_live_after_restore(torch_connect, tmp_path):
    gpu = torch_connect("trainer")
    model = make_model()
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt)
    for i in range(3):
        with gpu.turn():
            train_step(model, opt, i)
    gpu.park()
    path = tmp_path / "ckpt.pt"
    tracked.save_checkpoint(str(path))
    assert gpu.grant is None and all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
    ckpt = torch.load(path, weights_only=True)
    assert ckpt["rota"]["from_parked"] is True
    with gpu.turn():
        live_model = model.state_dict()
        live_opt = opt.state_dict()
    assert ckpt["model"].keys() == live_model.keys()
    for k, v in live_model.items():
        assert torch.equal(ckpt["model"][k], v), k
    assert ckpt["optimizer"]["param_groups"] == live_opt["param_groups"]
    assert ckpt["optimizer"]["state"].keys() == live_opt["state"].keys()
    for i, state in live_opt["state"].items():
        for k, v in state.items():
            assert torch.equal(ckpt["optimizer"]["state"][i][k], v), (i, k)
    fresh = make_model(seed=1)
    fresh_opt = make_optimizer(fresh)
    fresh.load_state_dict(ckpt["model"])
    fresh_opt.load_state_dict(ckpt["optimizer"])
    with gpu.turn():
        assert torch.equal(train_step(fresh, fresh_opt, 3), train_step(model, opt, 3))


def test_checkpoint_is_a_copy_not_a_view_of_the_pool(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    tracked = rota_fsdp.track(gpu, model)
    gpu.park()
    sd = tracked.state_dict()
    weight = sd["model"]["0.weight"]
    assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()
    for chunk in tracked.parker.pool.chunks:
        chunk.zero_()
    assert torch.count_nonzero(weight) > 0
    with pytest.raises(VerifyError, match="does not match its fingerprint"):  # the zeroed pool is caught
        tracked.restore()
    tracked.parker.verify = "off"  # let teardown restore the (zeroed) copy
