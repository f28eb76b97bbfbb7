"""Priority, weighted fair share and maximum turn length, through a real orchestrator."""

from __future__ import annotations

import time

import rota
from rota._engine import OrchestratorConfig
from rota._plugins import plugin_manager
from rota._state import GroupState, Waiter
from rota.policies import FairShare, Priority, make_policy
from rota.testing import running_orchestrator
from tests.core.test_parking import _wait


def test_priority_serves_highest_first_then_fifo():
    q = [Waiter("low", 1, 0, priority=0), Waiter("high", 2, 0, priority=5), Waiter("high2", 3, 0, priority=5)]
    assert Priority().choose(q, {}, 0).job_id == "high"


def test_fair_share_prefers_least_gpu_time_per_weight():
    g = GroupState("g")
    g.tenant("heavy").gpu_seconds = 10.0
    g.tenant("light").gpu_seconds = 4.0
    q = [Waiter("heavy", 1, 0, weight=4.0), Waiter("light", 2, 0, weight=1.0)]
    assert FairShare().choose(q, g.tenants, 0).job_id == "heavy"  # 10/4 < 4/1


def test_priority_policy_end_to_end():
    with running_orchestrator(OrchestratorConfig(policy=make_policy(plugin_manager(), "priority"))) as (ep, eng):
        holder = rota.connect(group="g", tenant="holder", endpoint=ep)
        low = rota.connect(group="g", tenant="low", endpoint=ep, priority=0)
        high = rota.connect(group="g", tenant="high", endpoint=ep, priority=9)
        holder.acquire()
        import threading

        order = []
        ts = [threading.Thread(target=lambda c=c: (c.acquire(), order.append(c.tenant), c.release()))
              for c in (low, high)]
        ts[0].start()
        _wait(lambda: eng.groups["g"].queued("low") is not None)
        ts[1].start()
        _wait(lambda: eng.groups["g"].queued("high") is not None)
        holder.release()
        for t in ts:
            t.join(20)
        assert order == ["high", "low"]
        for c in (holder, low, high):
            c.close()


def test_max_turn_asks_the_holder_to_yield_only_when_others_wait():
    policy = make_policy(plugin_manager(), "fifo", max_turn_s=0.2)
    with running_orchestrator(OrchestratorConfig(policy=policy)) as (ep, eng):
        holder = rota.connect(group="g", tenant="holder", endpoint=ep)
        grant = holder.acquire()
        assert grant.max_turn_ms == 200
        time.sleep(0.5)
        assert not holder.should_yield  # nobody waits: no reason to yield
        other = rota.connect(group="g", tenant="other", endpoint=ep)
        import threading

        t = threading.Thread(target=other.acquire)
        t.start()
        _wait(lambda: holder.should_yield)
        holder.release()
        t.join(20)
        assert eng.groups["g"].holder == "other"
        other.close()
        holder.close()
