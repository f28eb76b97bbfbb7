"""Through the real orchestrator: its park command parks the resident tenant before the next is granted."""

from __future__ import annotations

import threading
import time

import torch
from fsdp_testlib import make_model, make_optimizer, snapshot, train_step

import rota_fsdp


def test_orchestrator_parks_resident_tenant_before_granting_the_other(torch_connect):
    a, b = torch_connect("tenant-a"), torch_connect("tenant-b")
    model_a, model_b = make_model(0), make_model(1)
    opt_a, opt_b = make_optimizer(model_a), make_optimizer(model_b)
    tracked_a = rota_fsdp.track(a, model_a, opt_a)
    tracked_b = rota_fsdp.track(b, model_b, opt_b)

    with a.turn():
        train_step(model_a, opt_a, 0)
    info_state = snapshot(model_a, opt_a)
    assert not a.parked  # lazy parking: nobody waited, A stays resident

    granted_b: list[float] = []
    a_parked_at_grant: list[bool] = []

    def run_b() -> None:
        with b.turn():
            granted_b.append(time.monotonic())
            a_parked_at_grant.append(tracked_a.parked)
            train_step(model_b, opt_b, 0)

    thread = threading.Thread(target=run_b)
    thread.start()
    thread.join(30)
    assert not thread.is_alive() and granted_b
    assert a_parked_at_grant == [True]  # A was parked before B got the group
    assert a.parked and tracked_a.parked
    assert all(p.untyped_storage().nbytes() == 0 for p in model_a.parameters())
    park_events = [e for e in a.stats.events if e[0] == "park"]
    assert len(park_events) == 1 and park_events[0][2] <= granted_b[0]
    assert a.stats.parks[0].bytes_moved == sum(tracked_a.footprint().values())

    with a.turn():  # the orchestrator now parks B, and A's acquire restores A
        assert b.parked and tracked_b.parked and not tracked_a.parked
        restored = snapshot(model_a, opt_a)
        train_step(model_a, opt_a, 1)
    assert restored.keys() == info_state.keys()
    assert all(torch.equal(restored[k], info_state[k]) for k in info_state)
    assert len(a.stats.restores) == 1 and a.stats.restores[0].bytes_moved > 0
