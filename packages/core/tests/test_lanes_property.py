"""Property test of a group over several devices (rota._orchestrator: lanes over state), pure, under random turns.

Idle lanes take waiters of busy ones (``steal``), as the engine does. A job is in at most one lane at a time
(queued, switching, holding or resident); each lane has at most one holder, so no device is granted twice; a
holder's own lane is where its state is; with every footprint known, what a lane holds (residents and the
bytes of a state still moving out) never exceeds the device; and once holders keep releasing, every waiter is
granted (a grant that waits for a state to move out never waits for ever).
"""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from rota._orchestrator.lanes import choose_lane, evict_chooser, grant_waits_for_move, lanes_of, moved_in, steal
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
        if grant_waits_for_move(groups, g, chosen.job_id, CAPACITY):
            continue  # as the engine's driver: granted once the state in the way has moved out (moved_in)
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


def _drain(groups: dict[str, GroupState], now: float) -> None:
    """Holders release, round after round: every waiter is granted in the end (no grant waits for ever)."""
    for _ in range(4 * len(SIZES)):
        now += 1.0
        for g in lanes_of(groups, "g").values():
            if g.holder:
                job = g.holder
                g.release(job, g.token, 0, now)
                moved_in(groups, g, job)
        _grant_ready(groups, now)
        _check(groups)
    stuck = {dev: [w.job_id for w in g.queue] for dev, g in lanes_of(groups, "g").items() if g.queue}
    assert not stuck, f"waiters never granted: {stuck}"


@settings(max_examples=300, deadline=None)
@given(ops)
# j2 waits on fake:0 where parking resident j3 makes room; j3 then moves to fake:1 and holds it: once j0 releases
# fake:0, j2 must wait for j3's move (6,000 bytes of residue), not be granted over capacity
@example([("acquire", "j3", 1), ("acquire", "j0", 1), ("acquire", "j2", 1), ("release", "j3", 1),
          ("acquire", "j3", 2), ("release", "j0", 1)])
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
    _drain(groups, now)


def test_two_lanes_never_wait_for_each_others_moves():
    """x's state moves from fake:0 to fake:1 and y's the other way, each waiting in the other's lane, each in the way
    of the other's grant: neither grant waits (each would wait for the other for ever); once x holds fake:1, y's
    grant on fake:0 waits for x's move, which x's release ends."""
    groups = {gid: GroupState(gid) for gid in ("g@fake:0", "g@fake:1")}
    lane0, lane1 = groups["g@fake:0"], groups["g@fake:1"]
    for lane, mover, waiter in ((lane0, "x", "y"), (lane1, "y", "x")):
        lane.tenant(mover).residue_bytes = 6000  # left behind by its move (its state is idle here)
        lane.enqueue(TurnRequest(waiter, "g", footprint_bytes=6000, devices=DEVICES[:2]), 1.0)
        lane.tenant(waiter).state = "parked"
    assert not grant_waits_for_move(groups, lane0, "y", CAPACITY)
    assert not grant_waits_for_move(groups, lane1, "x", CAPACITY)
    lane1.begin_switch(lane1.queued("x"), CAPACITY)  # fake:1 grants x over y's bytes (as without this wait)
    lane1.complete_grant(2.0)
    assert grant_waits_for_move(groups, lane0, "y", CAPACITY)
    lane1.release("x", lane1.token, 0, 3.0)
    moved_in(groups, lane1, "x")
    assert not grant_waits_for_move(groups, lane0, "y", CAPACITY)
