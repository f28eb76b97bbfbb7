"""Work units and rota turns: queued units of one tenant share a turn, every unit reports where its time went,
and the service stops cleanly (workers first, then the base holder, none killed)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable

import tinker
from tinker import types
from tinker_testlib import KEYS, await_queued, batch

import rota
from rota.testing import running_orchestrator
from rota_tinker import ServiceConfig, Tenant, TinkerService

TIMEOUT = 120


def test_optim_step_queued_behind_forward_backward_shares_its_turn(
        service: TinkerService, client: Callable[[str], tinker.ServiceClient]) -> None:
    tc = client("alice").create_lora_training_client(base_model="rota/tiny", rank=4, seed=3).result(timeout=TIMEOUT)
    blocker = rota.connect(group=service.config.group, tenant="blocker", endpoint=service.config.endpoint)
    try:
        blocker.acquire()  # alice's trainer must wait for the group, so both units are queued when it gets it
        with service.state.lock:
            since = len(service.state.futures)
        fb = tc.forward_backward(batch(0, seed=5), "cross_entropy")
        op = tc.optim_step(types.AdamParams(learning_rate=1e-2))
        await_queued(service, "alice", ["ForwardBackward", "OptimStep"], since, TIMEOUT)
        blocker.release()
        loss = fb.result(timeout=TIMEOUT).metrics["loss:sum"]
        op.result(timeout=TIMEOUT)
    finally:
        blocker.close()
    with service.state.lock:
        ours = {f.request_id for f in list(service.state.futures.values())[since:]}
    units = {u["kind"]: u for u in service.unit_timings() if u["request_id"] in ours}
    assert units["ForwardBackward"]["new_turn"] == 1.0 and units["OptimStep"]["new_turn"] == 0.0
    assert units["OptimStep"]["acquire_s"] == 0.0 and "release_s" in units["OptimStep"]
    assert "release_s" not in units["ForwardBackward"]  # the turn went on to the optim_step
    for u in units.values():
        assert not u["failed"] and u["total_s"] >= u["compute_s"] > 0
    assert loss > 0


def test_stop_waits_for_workers_then_holder_and_kills_none(tmp_path: object) -> None:
    """A LoRA tenant on a shared base trains; stop() sees every worker and the holder exit by themselves."""
    tenant = Tenant("erin", "tml-HOm6rXaLCAPNR-gGrr0olO-edHUDE9bEyRmPCvKc5VM")
    assert tenant.api_key not in KEYS.values()
    with running_orchestrator() as (endpoint, _engine):
        svc = TinkerService(ServiceConfig(tenants=(tenant,), data_dir=tempfile.mkdtemp(dir=str(tmp_path)),
                                          endpoint=endpoint, group="tinker-stop", long_poll_s=2.0))
        svc.start()
        try:
            sc = tinker.ServiceClient(base_url=svc.url, api_key=tenant.api_key)
            tc = sc.create_lora_training_client(base_model="rota/tiny", rank=2, seed=1).result(timeout=TIMEOUT)
            tc.forward_backward(batch(0, seed=1), "cross_entropy").result(timeout=TIMEOUT)
            sc.close("success").result(timeout=TIMEOUT)  # POST sessions/{id}/finish: served, not a 404
            holder = svc.base_holder_info("rota/tiny")["pid"]
            assert holder is not None and svc.worker_pid("erin", "trainer") is not None
        finally:
            killed = svc.stop()
    assert killed == []
