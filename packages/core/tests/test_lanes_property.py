"""Property test of a group over several devices (rota._orchestrator: lanes over state), pure, under random turns.

Idle lanes take waiters of busy ones (``steal``), as the engine does. A job is in at most one lane at a time
(queued, switching, holding or resident); each lane has at most one holder, so no device is granted twice; a
holder's own lane is where its state is; and with every footprint known, what a lane holds (residents and the
bytes of a state still moving out) never exceeds the device.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rota._orchestrator.lanes import choose_lane, evict_chooser, lanes_of, moved_in, steal
from rota._orchestrator.state import GroupState
from rota.errors import NotHolder
from rota.policies import Fifo
from rota.types import TurnRequest

DEVICES = ("fake:0", "fake:1", "fake:2")
CAPACITY = 10_000
SIZES = {f"j{i}": n for i, n in enumerate((2000, 3000, 4500, 6000, 2500, 3500))}
ops = st.lists(st.tuples(st.sampled_from(["acquire", "acquire", "release", "release", "crash"]),
                         st.sampled_from(sorted(SIZES)), st.integers(1, 3)), min_size=1, max_size=120)


def _lane(groups: dict[str, GroupState], gid: str) -> GroupState:
    if gid not in groups:
        groups[gid] = GroupState(gid)
    return groups[gid]


def _grant_ready(groups: dict[str, GroupState], now: float) -> None:
    for g in list(lanes_of(groups, "g").values()):
        if not g.ready_for_grant():
            steal(groups, g, CAPACITY, now)  # an idle device takes a waiter of a busy one, as the engine does
        if not g.ready_for_grant():
            continue
        chosen = Fifo().choose(g.grantable(), g.tenants, now)
        for job in g.begin_switch(chosen, CAPACITY, evict_chooser(groups, g, CAPACITY)):
            g.mark_parked(job, SIZES[job], 0.0)
        g.complete_grant(now)


def _check(groups: dict[str, GroupState]) -> None:
    lanes = lanes_of(groups, "g")
    where: dict[str, str] = {}
    for dev, g in lanes.items():
        jobs = {g.holder, g.switching_to, *(w.job_id for w in g.queue), *g.residents} - {""}
        for job in jobs:
            assert where.setdefault(job, dev) == dev, f"{job} in lanes {where[job]} and {dev}"
        if g.holder:
            assert g.holder in g.residents  # its state is on its own device
        held = sum(g.tenant(j).footprint_bytes for j in g.residents) + g.residue_off("")
        assert held <= CAPACITY, f"{dev} holds {held} > {CAPACITY}: {g.residents}"


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_turns_over_three_devices_keep_the_invariants(sequence):
    groups: dict[str, GroupState] = {}
    now = 0.0
    for op, job, ndev in sequence:
        now += 1.0
        devices = DEVICES[:ndev]
        if op == "acquire":
            lane, left, _ = choose_lane(groups, "g", job, devices, SIZES[job], CAPACITY)
            g = _lane(groups, lane)
            if left:
                g.tenant(job).state = "parked"
            g.enqueue(TurnRequest(job, "g", footprint_bytes=SIZES[job], devices=devices), now)
        elif op == "release":
            for g in lanes_of(groups, "g").values():
                try:
                    g.release(job, g.token, 0, now)
                    moved_in(groups, g, job)
                except NotHolder:
                    pass
        else:
            for g in lanes_of(groups, "g").values():
                g.remove(job, now, lost=True)
        _grant_ready(groups, now)
        _check(groups)
