"""Priority, weighted fair share and maximum turn length, through a real orchestrator."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

import rota
from rota import plugin_manager
from rota._orchestrator.state import GroupState
from rota.orchestrator import OrchestratorConfig
from rota.policies import FairShare, Policy, Priority, TenantRecord, Waiter, available_policies, make_policy
from rota.testing import eventually, running_orchestrator


def test_priority_serves_highest_first_then_fifo():
    q = [Waiter("low", 1, 0, priority=0), Waiter("high", 2, 0, priority=5), Waiter("high2", 3, 0, priority=5)]
    assert Priority().choose(q, {}, 0).job_id == "high"


def test_fair_share_prefers_least_gpu_time_per_weight():
    g = GroupState("g")
    g.tenant("heavy").gpu_seconds = 10.0
    g.tenant("light").gpu_seconds = 4.0
    q = [Waiter("heavy", 1, 0, weight=4.0), Waiter("light", 2, 0, weight=1.0)]
    assert FairShare().choose(q, g.tenants, 0).job_id == "heavy"  # 10/4 < 4/1


def _grant_order(policy: Policy, priorities: dict[str, int]) -> list[str]:
    """Who gets the group next under ``policy`` once its holder releases: the waiters queue one after
    another in the order of ``priorities`` (tenant -> priority) while "holder" holds the group."""
    with running_orchestrator(OrchestratorConfig(policy=policy)) as (ep, eng):
        holder = rota.connect(group="g", tenant="holder", endpoint=ep)
        waiters = [rota.connect(group="g", tenant=t, endpoint=ep, priority=p) for t, p in priorities.items()]
        holder.acquire()
        order: list[str] = []
        threads = [threading.Thread(target=lambda c=c: (c.acquire(), order.append(c.tenant), c.release()))
                   for c in waiters]
        for c, t in zip(waiters, threads, strict=True):
            t.start()
            eventually(lambda c=c: eng.groups["g"].queued(c.tenant) is not None, f"{c.tenant} queued")
        holder.release()
        for t in threads:
            t.join(20)
        for c in (holder, *waiters):
            c.close()
    return order


def test_priority_policy_end_to_end():
    assert _grant_order(make_policy(plugin_manager(), "priority"), {"low": 0, "high": 9}) == ["high", "low"]


def test_max_turn_asks_the_holder_to_yield_only_when_others_wait():
    policy = make_policy(plugin_manager(), "fifo", max_turn_s=0.2)
    with running_orchestrator(OrchestratorConfig(policy=policy)) as (ep, eng):
        holder = rota.connect(group="g", tenant="holder", endpoint=ep)
        grant = holder.acquire()
        assert grant.max_turn_ms == 200
        time.sleep(0.5)
        assert not holder.should_yield  # nobody waits: no reason to yield
        other = rota.connect(group="g", tenant="other", endpoint=ep)
        t = threading.Thread(target=other.acquire)
        t.start()
        eventually(lambda: holder.should_yield)
        holder.release()
        t.join(20)
        assert eng.groups["g"].holder == "other"
        other.close()
        holder.close()


def test_resident_first_serves_residents_and_holds_a_parked_job_back_until_due():
    from rota.policies import Fifo, ResidentFirst

    g = GroupState("g")
    for job, state in (("parked", "parked"), ("res", "resident"), ("away", "resident")):
        g.tenant(job).state = state
        g.tenant(job).last_active = 1.9  # the residents took turns just before: the device is not idle
    policy = ResidentFirst(Fifo(), patience_s=10.0)
    q = [Waiter("parked", 1, 0.0), Waiter("res", 2, 1.0)]
    assert policy.choose(q, g.tenants, 2.0).job_id == "res"  # on the device already, though it came later
    q = [Waiter("parked", 1, 0.0)]
    assert policy.choose(q, g.tenants, 2.0) is None  # 'res' and 'away' are on the device: wait for room
    assert policy.choose(q, g.tenants, 10.0).job_id == "parked"  # waited its patience out
    for job, size in (("parked", 60), ("res", 60), ("away", 60)):
        g.tenant(job).footprint_bytes = size
    roomy = ResidentFirst(Fifo(), patience_s=10.0, capacity_bytes=130)
    assert roomy.choose(q, g.tenants, 2.0) is None  # 60 more beside 120 resident: it would park someone
    g.tenant("away").state = "idle"  # one left: 'parked' fits beside 'res', a restore and no park
    assert roomy.choose(q, g.tenants, 2.0).job_id == "parked"
    assert policy.choose(q, g.tenants, 2.0) is None  # without the device's size it cannot know that
    g.tenant("res").state = "idle"  # nothing left on the device to wait for
    assert policy.choose(q, g.tenants, 2.0).job_id == "parked"
    assert policy.name == "fifo+resident-first"


def _three_jobs_room_for_two(ep: str, eng: object) -> tuple[dict[str, rota.Gpu], dict[str, object]]:
    """a, b, c of 1000 bytes each in a group with room for two: c's first turn parks a (the oldest resident)."""
    from rota.testing import ListState

    gpus = {j: rota.connect(group="g", tenant=j, endpoint=ep) for j in ("a", "b", "c")}
    states = {j: ListState(gpu) for j, gpu in gpus.items()}
    for j in ("a", "b", "c"):
        with gpus[j].turn():
            pass
    assert eng.groups["g"].tenants["a"].state == "parked"
    return gpus, states


def _acquire_in_thread(gpu: rota.Gpu, got: list[tuple[float, int]], parks: Any) -> threading.Thread:
    """``gpu`` acquires in a thread; ``got`` receives when it was granted and ``parks()`` at that moment."""
    t = threading.Thread(target=lambda: (gpu.acquire(), got.append((time.monotonic(), parks())), gpu.release()))
    t.start()
    return t


def test_resident_first_end_to_end_grants_the_parked_job_once_due():
    """Two jobs fit, a third does not: the parked one waits while the residents keep taking turns, then gets in
    once its patience is out, and one resident is parked to make room."""
    from rota.policies import Fifo, ResidentFirst

    config = OrchestratorConfig(capacity_bytes=2000, policy=ResidentFirst(Fifo(), patience_s=1.0))
    with running_orchestrator(config) as (ep, eng):
        gpus, states = _three_jobs_room_for_two(ep, eng)
        t0, got = time.monotonic(), []
        waiter = _acquire_in_thread(gpus["a"], got, lambda: states["b"].calls.count("park")
                                    + states["c"].calls.count("park"))
        while not got and time.monotonic() - t0 < 10:  # b and c use the device all along (milliseconds a turn)
            for j in ("b", "c"):
                with gpus[j].turn():
                    pass
        waiter.join(timeout=10)
        assert got and got[0][0] - t0 >= 0.9  # a got in only once its patience ran out
        assert got[0][1] == 1  # and one of them was parked to make room for it
        for j in gpus:
            states[j].close()
            gpus[j].close()


def test_resident_first_end_to_end_grants_the_parked_job_once_the_residents_leave_the_device_idle():
    """The same three jobs, a patience of a minute: b and c take two turns each and then stop using the device
    (e.g. waiting on the parked job itself). a gets in once the device has been idle for what letting it in costs
    (here the recheck's 0.25 s: a thousand bytes), not a minute later."""
    from rota.policies import Fifo, ResidentFirst

    config = OrchestratorConfig(capacity_bytes=2000, policy=ResidentFirst(Fifo(), patience_s=60.0))
    with running_orchestrator(config) as (ep, eng):
        gpus, states = _three_jobs_room_for_two(ep, eng)
        got: list[tuple[float, int]] = []
        waiter = _acquire_in_thread(gpus["a"], got, lambda: states["b"].calls.count("park")
                                    + states["c"].calls.count("park"))
        eventually(lambda: eng.groups["g"].queued("a") is not None, "a queued")
        for _ in range(2):
            for j in ("b", "c"):
                with gpus[j].turn():
                    pass
        idle_from = time.monotonic()
        waiter.join(timeout=20)
        assert got and 0.2 <= got[0][0] - idle_from < 10, (got, idle_from)
        assert got[0][1] == 1
        for j in gpus:
            states[j].close()
            gpus[j].close()


def test_resident_first_waits_for_idle_time_worth_the_switch_then_lets_the_parked_job_in():
    """Rent or buy: a parked job that does not fit gets in once the residents have left the device idle for
    what letting it in costs (its restore, the parks and restores of what makes room), at the rate the group's
    parks measured, else the policy's default; never while a resident holds the device; and with no footprint
    to price it, only after its patience, as before."""
    from rota.policies import Fifo, ResidentFirst

    gb = 10**9
    g = GroupState("g")
    for job, state in (("parked", "parked"), ("res", "resident"), ("away", "resident")):
        rec = g.tenant(job)
        rec.state, rec.footprint_bytes, rec.last_active = state, 60 * gb, 10.0
    policy = ResidentFirst(Fifo(), patience_s=60.0, capacity_bytes=130 * gb)  # 25 GB/s until parks are measured
    q = [Waiter("parked", 1, 9.0)]
    # cost: its 60 GB restored, 50 GB parked to make room and restored later: 160 GB at 25 GB/s = 6.4 s
    assert policy.choose(q, g.tenants, 16.0) is None  # idle 6.0 s
    assert policy.choose(q, g.tenants, 16.5) is q[0]  # idle 6.5 s
    g.tenant("res").state = "holding"
    assert policy.choose(q, g.tenants, 30.0) is None  # a resident holds the device: not idle
    g.tenant("res").state = "resident"
    g.tenant("away").parked_bytes, g.tenant("away").parks_ms = 50 * gb, deque([1000.0])  # parks ran 50 GB/s
    assert policy.choose(q, g.tenants, 13.1) is None  # 160 GB at 50 GB/s = 3.2 s
    assert policy.choose(q, g.tenants, 13.3) is q[0]
    g.tenant("parked").footprint_bytes = 0  # its size unknown: no price, it waits for its patience
    assert policy.choose(q, g.tenants, 68.9) is None
    assert policy.choose(q, g.tenants, 69.0) is q[0]


def test_resident_first_lets_a_parked_job_displace_only_lower_priority_residents():
    """Three 60-byte jobs, room for two: a parked high-priority job is served at once when parking a
    low-priority resident makes room, and the switch parks that one, not its high-priority peer."""
    from rota.policies import Priority, ResidentFirst

    g = GroupState("g")
    for job, state, prio in (("rl-b", "parked", 1), ("rl-a", "resident", 1), ("sft", "resident", 0)):
        rec = g.tenant(job)
        rec.state, rec.priority, rec.footprint_bytes = state, prio, 60
    g.residents = ["rl-a", "sft"]  # rl-a became resident first: oldest-first would park it
    policy = ResidentFirst(Priority(), patience_s=60.0, capacity_bytes=130)
    rl_b = Waiter("rl-b", 1, 0.0, priority=1)
    assert policy.choose([rl_b], g.tenants, 1.0) is rl_b  # long before its patience: it outranks sft
    g.queue.append(rl_b)
    assert g.begin_switch(rl_b, 130) == ["sft"]  # the lower priority goes to the host, rl-a stays
    sft = Waiter("sft", 2, 0.0, priority=0)
    for job, state in (("rl-b", "resident"), ("sft", "parked")):
        g.tenant(job).state = state
    g.tenant("rl-b").last_active = 58.9  # rl-b uses the device: not idle
    assert policy.choose([sft], g.tenants, 59.0) is None  # low priority: waits for room (or its patience)
    assert policy.choose([sft], g.tenants, 60.0) is sft
    g.tenant("sft").priority = 1  # equal priorities: nobody displaces anybody
    assert policy.choose([Waiter("sft", 3, 0.0, priority=1)], g.tenants, 1.0) is None


def test_a_plugin_policy_typed_on_the_public_types_is_available_and_decides_the_grant():
    """A policy plugin as a third party writes it: rota.policies' Waiter/TenantRecord, rota_register_policies."""
    from rota.testing import new_plugin_manager

    class Newest:
        name, max_turn_s = "newest", 0.0

        def choose(self, queue: list[Waiter], tenants: dict[str, TenantRecord], now: float) -> Waiter:
            return max(queue, key=lambda w: w.seq)

    class NewestPlugin:
        @rota.hookimpl
        def rota_register_policies(self, register):
            register("newest", lambda max_turn_s=0.0: Newest())

    pm = new_plugin_manager(load_entry_points=False)
    pm.register(NewestPlugin())
    assert sorted(available_policies(pm)) == ["fair", "fifo", "newest", "priority"]
    assert _grant_order(make_policy(pm, "newest"), {"first": 0, "second": 0}) == ["second", "first"]
