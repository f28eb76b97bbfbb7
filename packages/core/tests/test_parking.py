"""Snapshot hooks around turns: lazy parking, park before another tenant's grant,
restore at the next turn, residency-aware switching, and a failing park faults the job.

The state parked here is a Python list standing in for device tensors (the adapters'
own tests park real torch tensors); what is tested is when rota calls the hooks.
"""

from __future__ import annotations

import threading
import time

import pytest

import rota
from rota.orchestrator import OrchestratorConfig
from rota.testing import ListState, eventually, running_orchestrator


@pytest.fixture
def two_tenants(orchestrator):
    endpoint, engine = orchestrator
    a = rota.connect(group="g", tenant="a", endpoint=endpoint)
    b = rota.connect(group="g", tenant="b", endpoint=endpoint)
    sa, sb = ListState(a), ListState(b)
    yield engine, a, b, sa, sb
    for x in (sa, sb):
        x.close()
    for gpu in (a, b):
        gpu.close()


def test_release_with_nobody_waiting_parks_nothing(two_tenants):
    engine, a, _, sa, _ = two_tenants
    a.acquire()
    info = a.release()
    assert info.snapshot_deferred and info.pending_waiters == 0
    assert sa.calls == [] and sa.device is not None
    assert engine.groups["g"].status_name() == "IDLE_YIELDED"


def test_resident_is_parked_before_next_grant_and_restored_on_its_turn(two_tenants):
    engine, a, b, sa, sb = two_tenants
    a.acquire()
    a.release()  # deferred: a stays resident
    grant_b = b.acquire()  # a must be parked first
    assert sa.calls == ["park"] and sa.device is None and sa.host is not None
    assert not grant_b.context_restored
    b.release()
    grant_a = a.acquire()
    assert grant_a.context_restored and sa.calls == ["park", "restore"] and sa.device == list(range(10))
    assert sb.calls == ["park"]
    a.release()
    tenants = engine.groups["g"].tenants
    assert tenants["a"].parked_bytes == 1000 and tenants["b"].state == "parked"


def test_residents_that_fit_are_not_parked():
    with running_orchestrator(OrchestratorConfig(capacity_bytes=5000)) as (endpoint, _):
        a = rota.connect(group="g", tenant="a", endpoint=endpoint)
        b = rota.connect(group="g", tenant="b", endpoint=endpoint)
        sa, sb = ListState(a), ListState(b)
        a.acquire()
        a.release()
        b.acquire()
        b.release()
        assert sa.calls == [] and sb.calls == []
        for x in (sa, sb, a, b):
            x.close()


def test_footprint_hint_makes_room_before_a_job_has_built_anything():
    """A job about to build a 4000-byte model says so; the 3000-byte resident is parked for its first turn
    (without the hint the newcomer counts as 0 bytes and would run out of memory beside the resident)."""
    with running_orchestrator(OrchestratorConfig(capacity_bytes=5000)) as (endpoint, _):
        a = rota.connect(group="g", tenant="a", endpoint=endpoint)
        sa = ListState(a, nbytes=3000)
        a.acquire()
        a.release()
        for hint, parked in ((1000, []), (4000, ["park"])):
            b = rota.connect(group="g", tenant=f"b{hint}", endpoint=endpoint, footprint_hint=hint)
            assert b.footprint_bytes() == hint  # nothing tracked yet
            b.acquire()
            assert sa.calls == parked
            b.release()
            b.close()
        sb = ListState(rota.connect(group="g", tenant="c", endpoint=endpoint, footprint_hint=4000), nbytes=10)
        assert sb.gpu.footprint_bytes() == 10  # once an adapter tracks state, its bytes count, not the hint
        for x in (sa, sb, a, sb.gpu):
            x.close()
    with pytest.raises(rota.errors.ConfigError, match="footprint_hint=-1"):
        rota.Gpu("g", "t", "127.0.0.1:1", footprint_hint=-1)


def test_work_after_a_turn_runs_with_the_state_on_the_device_and_the_next_park_waits_for_it(two_tenants):
    """``turn(after=...)``: a copy out of device state after the release overlaps the next tenant's
    grant, but the park that grant needs cannot start before the copy is done."""
    engine, a, b, sa, _sb = two_tenants
    seen = {}

    def copy_out() -> None:
        seen["start"], seen["state"] = time.monotonic(), list(sa.device or [])
        time.sleep(0.5)
        seen["end"] = time.monotonic()

    granted = []
    with a.turn(after=copy_out):
        waiter = threading.Thread(target=lambda: (b.acquire(), granted.append(time.monotonic())))
        waiter.start()
        eventually(lambda: engine.groups["g"].queued("b") is not None)
    waiter.join(timeout=10)
    assert seen["state"] == list(range(10))  # still on the device while it was copied
    assert sa.calls == ["park"] and granted and granted[0] >= seen["end"]  # parked only after the copy
    assert [k for k, *_ in a.stats.events][-3:] == ["turn", "after", "park"]
    b.release()


def test_failing_park_faults_the_job_and_group_moves_on(orchestrator):
    endpoint, engine = orchestrator
    a = rota.connect(group="g", tenant="a", endpoint=endpoint)
    b = rota.connect(group="g", tenant="b", endpoint=endpoint)
    sa = ListState(a, fail=True)
    a.acquire()
    a.release()
    assert b.acquire().job_id == "b"  # granted despite a's failed park
    assert engine.groups["g"].tenants["a"].state == "faulted"
    # a's state is still on the device (the park rolled back): its heartbeats say so, so the orchestrator counts
    # it against the device instead of as free (before, a faulted tenant reported 0 left)
    assert a.park_failed and sa.device is not None
    eventually(lambda: engine.groups["g"].tenants["a"].residue_bytes == 1000, "a's state counted as left")
    sa.close()
    a.close()
    b.close()


def test_failing_park_of_a_waiting_resident_does_not_strand_its_acquire(orchestrator):
    """a holds; c, then b (resident from its last turn) queue. c's grant parks b, which fails:
    b is FAULTED and leaves the queue, and its pending acquire fails with the cause, which
    the client retries (FAULTED is retryable), so b queues again and gets the turn after c.
    Before, the acquire waited forever for a grant that could no longer come."""
    endpoint, engine = orchestrator
    a, b, c = (rota.connect(group="g", tenant=t, endpoint=endpoint) for t in "abc")
    sb = ListState(b, fail=True)
    b.acquire()
    b.release()
    a.acquire()
    g = engine.groups["g"]
    got: list[str] = []
    tc = threading.Thread(target=lambda: got.append(c.acquire().job_id))
    tc.start()
    eventually(lambda: g.queued("c") is not None)
    tb = threading.Thread(target=lambda: got.append(b.acquire().job_id))
    tb.start()
    eventually(lambda: g.queued("b") is not None)
    a.release()
    tc.join(20)
    assert got == ["c"] and sb.calls == ["park"]  # b's park failed; c holds anyway
    eventually(lambda: g.tenants["b"].fault != "" and g.queued("b") is not None)  # faulted, then queued again
    assert "device said no" in g.tenants["b"].fault
    c.release()
    tb.join(20)
    assert not tb.is_alive() and got == ["c", "b"], "b's acquire was stranded by its failed park"
    b.release()
    for x in (sb, a, b, c):
        x.close()


def test_waiting_resident_is_parked_while_it_waits(two_tenants):
    """a releases and immediately queues again behind b: a is parked for b's turn."""
    engine, a, b, sa, _ = two_tenants
    a.acquire()
    b_granted = threading.Event()
    t = threading.Thread(target=lambda: (b.acquire(), b_granted.set()))
    t.start()
    eventually(lambda: engine.groups["g"].queued("b") is not None)
    a.release()
    t.join(20)
    assert b_granted.is_set() and sa.calls == ["park"]
    b.release()
    assert a.acquire().context_restored
    a.release()


def test_resident_that_dies_during_its_park_does_not_stall_the_group(orchestrator, child_env):
    """The park command goes to a process that then dies: the grant follows its death,
    not the park timeout."""
    import subprocess
    import sys

    endpoint, engine = orchestrator
    script = (
        "import sys, time, rota\n"
        "class Stuck:\n"
        "    @rota.hookimpl\n"
        "    def rota_park(self, tenant, plan):\n"
        "        print('parking', flush=True); time.sleep(3600)\n"
        "    @rota.hookimpl\n"
        "    def rota_footprint(self, tenant):\n"
        "        return {'weights': 1}\n"
        f"gpu = rota.connect(group='g', tenant='stuck', endpoint={endpoint!r})\n"
        "gpu.pm.register(Stuck())\n"
        "gpu.acquire(); gpu.release(); print('released', flush=True)\n"
        "time.sleep(3600)\n")
    victim = subprocess.Popen([sys.executable, "-c", script], env=child_env, stdout=subprocess.PIPE, text=True)
    try:
        assert victim.stdout.readline().strip() == "released"
        b = rota.connect(group="g", tenant="b", endpoint=endpoint)
        got = threading.Event()
        t = threading.Thread(target=lambda: (b.acquire(), got.set()))
        t.start()
        assert victim.stdout.readline().strip() == "parking"
        assert not got.wait(0.5)  # b waits while the park is under way
        victim.kill()
        assert got.wait(engine.config.park_timeout_s * 0.8), "grant waited for the park timeout"
        assert engine.groups["g"].tenants["stuck"].state == "lost"
        t.join(5)
        b.close()
    finally:
        victim.kill()
        victim.wait(10)


def test_tenant_that_acquires_right_after_connect_is_still_parked(orchestrator, monkeypatch):
    """The first acquire waits until the session is registered: otherwise the
    orchestrator would not know whom to ask, and a later grant would skip the park.
    The session thread is made slow to start, so the race is certain to happen."""
    import time

    endpoint, _ = orchestrator
    slow_start = rota.Gpu._run_session

    def delayed(self):
        time.sleep(0.5)
        slow_start(self)

    monkeypatch.setattr(rota.Gpu, "_run_session", delayed)
    a = rota.connect(group="race", tenant="a", endpoint=endpoint)
    sa = ListState(a)
    a.acquire()  # immediately, no pause after connect
    a.release()
    b = rota.connect(group="race", tenant="b", endpoint=endpoint)
    b.acquire()
    assert sa.calls == ["park"], f"resident was not parked ({sa.calls})"
    b.release()
    for x in (sa, a, b):
        x.close()


def test_status_shows_host_memory_residue_and_fault(orchestrator, monkeypatch):
    """Heartbeats carry what the last park left: host bytes, residue; a failed park's
    cause is kept as the tenant's fault, shown by `rota status`."""
    from rota.admin import fetch_status
    from rota.cli.status import prometheus_text, render_table
    from rota.wire import rota_v1_pb2 as pb

    monkeypatch.setenv("ROTA_HEARTBEAT_S", "0.05")
    endpoint, engine = orchestrator
    a = rota.connect(group="mem", tenant="a", endpoint=endpoint)
    b = rota.connect(group="mem", tenant="b", endpoint=endpoint)
    sa, sb = ListState(a), ListState(b, fail=True)
    original = sa.rota_park

    def park_with_memory(tenant, plan):
        result = original(tenant, plan)
        if result is not None:
            result.host_bytes, result.residue = 4096, {"untracked:cache": 512}
        return result

    sa.rota_park = rota.hookimpl(park_with_memory)
    a.pm.unregister(sa)
    a.pm.register(sa, name="state-a-mem")
    a.acquire()
    a.release()
    b.acquire()  # parks a
    eventually(lambda: engine.groups["mem"].tenants["a"].host_bytes == 4096)
    b.release()
    a.acquire()  # parks b, whose park fails: b is FAULTED with the cause
    a.release()
    reply = fetch_status(endpoint, "mem")
    tenants = {t.job_id: t for t in reply.groups[0].tenants}
    assert tenants["a"].host_bytes == 4096
    assert tenants["b"].state == "faulted" and "device said no" in tenants["b"].fault
    assert (tenants["b"].parks_failed, tenants["a"].parks_failed) == (1, 0)  # counted, not only the last cause
    table = render_table(reply)
    assert "host mem" in table and "b FAULTED: park failed" in table and "failed p/r" in table
    assert " 1/0" in next(line for line in table.splitlines() if line.strip().startswith("b "))
    metrics = prometheus_text(reply)
    assert 'rota_tenant_host_bytes{group="mem",job="a"} 4096.0' in metrics
    assert 'rota_tenant_switch_failures_total{group="mem",job="b",kind="park"} 1.0' in metrics
    assert b.stats.failed("park") == 1  # the tenant's own count, which results (the demo's JSON) read
    assert isinstance(reply, pb.StatusReply)
    for x in (sa, sb, a, b):
        x.close()


class _Part:
    """One adapter's part of a tenant's park: it frees ``frees`` bytes of a process-wide ``allocated`` count."""

    def __init__(self, gpu: rota.Gpu, process: dict[str, int], frees: int) -> None:
        self.gpu, self.process, self.frees = gpu, process, frees

    @rota.hookimpl
    def rota_park(self, tenant: rota.Gpu, plan: rota.ParkPlan) -> rota.ParkResult | None:
        if tenant is not self.gpu:
            return None
        self.process["allocated"] -= self.frees  # what this part parked is gone from the process now
        return rota.ParkResult(bytes_moved=self.frees,
                               residue={"process:allocated": self.process["allocated"], "untracked:x": 1})


def test_process_readings_of_several_parts_are_the_last_ones(orchestrator):
    """Two adapters park one tenant in turn (a full model and a LoRA adapter in one trainer): the first part's
    reading of the process's allocator still holds the second part's state, so only the last reading says what
    the park left. Taking the largest made every such park a false residue fault."""
    endpoint, _ = orchestrator
    gpu = rota.connect(group="g", tenant="two-parts", endpoint=endpoint)
    process = {"allocated": 13 << 30}
    parts = [_Part(gpu, process, 10 << 30), _Part(gpu, process, 3 << 30)]
    for i, part in enumerate(parts):
        gpu.pm.register(part, name=f"part-{i}")
    try:
        result = gpu.park()
        assert process["allocated"] == 0
        assert result.residue["process:allocated"] == 0
        assert result.residue["untracked:x"] == 2  # named residue still adds up over the parts
        assert result.bytes_moved == 13 << 30
    finally:
        for i in range(len(parts)):
            gpu.pm.unregister(name=f"part-{i}")
        gpu.close()


def test_recheck_park_measures_again_after_the_tenant_freed_what_it_left(orchestrator):
    endpoint, _ = orchestrator
    gpu = rota.connect(group="g", tenant="leaky", endpoint=endpoint)
    state = ListState(gpu, leaves=1 << 30)
    try:
        with pytest.raises(rota.residue.ResidueError, match=r"untracked:state\.cache 1024\.0 MiB"):
            gpu.park()
        assert "untracked:state.cache" in gpu.recheck_park()  # nothing freed yet: still a fault, still named
        state.leaves = 0
        assert gpu.recheck_park() == ""
        assert gpu.last_park.residue == {"untracked:state.cache": 0} and gpu.stats.parks[-1] is gpu.last_park
        assert state.host == list(range(10))  # re-reading moved nothing
    finally:
        state.close()
        gpu.close()


def test_an_orchestrator_stopped_mid_park_leaves_no_unretrieved_exception(caplog):
    """Stopping the orchestrator while a park waits for its acknowledgement (``rota demo`` interrupted by Ctrl-C)
    once left a gathering future whose CancelledError nobody retrieved: asyncio logged it at exit, after the
    demo's last words."""
    import gc
    import logging

    parking, unblock = threading.Event(), threading.Event()

    class Slow:  # a's park, acknowledged only once unblocked (the plugin manager is the process's: a only)
        def __init__(self, gpu):
            self.gpu = gpu

        @rota.hookimpl
        def rota_park(self, tenant, plan):
            if tenant is self.gpu:
                parking.set()
                unblock.wait(30)

        @rota.hookimpl
        def rota_footprint(self, tenant):
            return {"weights": 1} if tenant is self.gpu else None

    caplog.set_level(logging.ERROR, logger="asyncio")
    asked: list[object] = []
    with running_orchestrator() as (endpoint, _):
        a = rota.connect(group="g", tenant="a", endpoint=endpoint)
        b = rota.connect(group="g", tenant="b", endpoint=endpoint)
        slow = Slow(a)
        a.pm.register(slow)

        def ask() -> None:  # b's grant never comes: the orchestrator stops, then b is closed
            try:
                asked.append(b.acquire())
            except rota.errors.RotaError as e:  # the client closed under it
                asked.append(e)

        t = threading.Thread(target=ask, daemon=True)
        try:
            a.acquire()
            a.release()
            t.start()
            assert parking.wait(20), "the park never started"
        finally:
            a.pm.unregister(slow)  # a's park under way keeps waiting for unblock
    unblock.set()  # the orchestrator is gone: the park's acknowledgement goes nowhere
    for c in (a, b):
        c.close()
    t.join(30)
    assert asked and isinstance(asked[0], rota.errors.RotaError), asked
    gc.collect()
    never = [r.getMessage() for r in caplog.records if "never retrieved" in r.getMessage()]
    assert not never, never
