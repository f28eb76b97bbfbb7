"""Bad input is refused with a message naming the problem."""

from __future__ import annotations

import pytest
import torch
from fsdp_testlib import make_model, make_optimizer, train_step

import rota_fsdp
from rota.errors import InvalidArgument


def test_model_on_another_device_than_the_tenant(torch_connect):
    gpu = torch_connect("trainer")
    rota_fsdp.track(gpu, make_model(), device="cpu")
    with pytest.raises(rota_fsdp.DeviceMismatch, match="meta"):
        rota_fsdp.track(gpu, make_model(), device="meta")


def test_model_spanning_devices(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    model[0].register_buffer("on_meta", torch.empty(3, device="meta"))
    with pytest.raises(rota_fsdp.DeviceMismatch, match=r"'0\.on_meta' is on meta but the tenant's device is cpu"):
        rota_fsdp.track(gpu, model)


def test_double_track(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    first = rota_fsdp.track(gpu, model)
    with pytest.raises(rota_fsdp.AlreadyTracked, match="already tracked"):
        rota_fsdp.track(gpu, model)
    with pytest.raises(rota_fsdp.AlreadyTracked, match=r"parameter 'weight'"):
        rota_fsdp.track(gpu, model[0])  # a child of a tracked model
    other = torch_connect("other")
    with pytest.raises(rota_fsdp.AlreadyTracked):
        rota_fsdp.track(other, model)
    first.untrack()
    rota_fsdp.track(gpu, model)  # fine once untracked


def test_unknown_tag_and_discard_of_untracked_tag(torch_connect):
    gpu = torch_connect("trainer")
    with pytest.raises(rota_fsdp.TrackingError, match="kv_cache"):
        rota_fsdp.track(gpu, make_model(), tags=("weights", "kv_cache"))
    with pytest.raises(rota_fsdp.TrackingError, match="grads"):
        rota_fsdp.track(gpu, make_model(), tags=("weights",), discard=("grads",))


def test_park_while_holding_the_turn(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    tracked = rota_fsdp.track(gpu, model)
    with gpu.turn():
        with pytest.raises(rota_fsdp.HoldsTurn, match="holds group"):
            tracked.park()
        with pytest.raises(InvalidArgument):
            gpu.park()
    assert not tracked.parked


def test_park_while_backward_in_flight(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt)
    seen: list[str] = []

    def park_now(grad):
        try:
            tracked.park()
        except rota_fsdp.BackwardInFlight as exc:
            seen.append(str(exc))  # the message only: the exception's frames would keep the model's host pool alive
        return grad

    # Outside a turn (the orchestrator's park arrives on the session thread between turns),
    # a backward pass through the model is running when park is asked from inside it.
    loss = model(torch.randn(16, 8)).sum()
    handle = model[0].weight.register_hook(park_now)
    loss.backward()
    handle.remove()
    assert len(seen) == 1 and "backward" in seen[0]
    assert not tracked.parked and not tracked.backward_in_flight
    gpu.park()  # after the backward it is allowed
    assert tracked.parked
    with gpu.turn():
        train_step(model, opt, 1)


def test_forward_while_parked(torch_connect):
    gpu = torch_connect("trainer")
    model = make_model()
    rota_fsdp.track(gpu, model)
    gpu.park()
    with pytest.raises(RuntimeError, match="is parked"):
        model(torch.randn(2, 8))
