"""Property test of the group state machine under random acquire/release/crash/timeout.

Never more than one holder, tokens only grow, FIFO is respected, every waiter is
eventually served once holders keep releasing.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rota._orchestrator.state import GroupState
from rota.errors import NotHolder, StaleToken
from rota.policies import Fifo
from rota.types import TurnRequest

JOBS = [f"j{i}" for i in range(5)]
ops = st.lists(st.tuples(st.sampled_from(["acquire", "release", "crash", "timeout", "stale"]),
                         st.sampled_from(JOBS)), min_size=1, max_size=80)


def _grant_if_ready(g: GroupState, now: float, order: list[str]) -> None:
    if g.ready_for_grant():
        chosen = Fifo().choose(g.queue, g.tenants, now)
        assert chosen.seq == min(w.seq for w in g.queue)  # FIFO by arrival
        for job in g.begin_switch(chosen, 0):
            g.mark_parked(job, 0, 0.0)
        before = g.token
        grant = g.complete_grant(now)
        assert grant.token == before + 1
        order.append(grant.job_id)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_sequences_keep_invariants(sequence):
    g = GroupState("g")
    now, arrivals, granted = 0.0, [], []
    last_token = 0
    for op, job in sequence:
        now += 1.0
        if op == "acquire":
            if g.holder != job and g.queued(job) is None:
                arrivals.append(job)
            g.enqueue(TurnRequest(job, "g"), now)
        elif op == "release":
            try:
                g.release(job, g.token, 0, now)
                assert g.holder != job
            except NotHolder:
                assert g.holder != job
        elif op == "stale" and g.holder and g.token > 1:
            try:
                g.release(g.holder, g.token - 1, 0, now)
                raise AssertionError("stale token accepted")
            except StaleToken:
                pass
        elif op in ("crash", "timeout"):
            g.remove(job, now, lost=op == "crash")
            if job in arrivals:
                arrivals = [a for a in arrivals if a != job]
        _grant_if_ready(g, now, granted)
        assert g.token >= last_token
        last_token = g.token
        assert len({g.holder} - {""}) <= 1
        assert g.holder not in [w.job_id for w in g.queue]
        assert len({w.job_id for w in g.queue}) == len(g.queue)
    # drain: holders keep releasing, so every remaining waiter is served in arrival order
    waiting = [w.job_id for w in sorted(g.queue, key=lambda w: w.seq)]
    served = []
    for _ in range(len(JOBS) + 1):
        if g.holder:
            g.release(g.holder, g.token, 0, now)
        _grant_if_ready(g, now, served)
    assert served[: len(waiting)] == waiting
    assert not g.queue


def _both_ranks(g: GroupState, job: str, now: float) -> None:
    for rank in (0, 1):
        assert g.enqueue(TurnRequest(job, "g", world_size=2, rank=rank), now) is None


def test_job_of_two_ranks_is_granted_only_once_both_asked():
    """Rank 0 alone must not take the group: it would hold it while waiting for rank 1 in a collective."""
    g = GroupState("g")
    g.enqueue(TurnRequest("a", "g", world_size=2, rank=0), 1.0)
    g.enqueue(TurnRequest("b", "g"), 1.5)
    assert [w.job_id for w in g.grantable()] == ["b"]
    g.enqueue(TurnRequest("a", "g", world_size=2, rank=0), 1.6)  # the same rank again counts once
    assert [w.job_id for w in g.grantable()] == ["b"]
    g.enqueue(TurnRequest("a", "g", world_size=2, rank=1), 2.0)
    assert [w.job_id for w in g.grantable()] == ["a", "b"]
    assert GroupState.from_dict(g.to_dict()).queue[0].ranks == [0, 1]


def test_round_trip_through_dict():
    g = GroupState("g")
    _both_ranks(g, "a", 1.0)
    g.begin_switch(g.queue[0], 0)
    g.complete_grant(2.0)
    g.enqueue(TurnRequest("b", "g"), 3.0)
    assert GroupState.from_dict(g.to_dict()).to_dict() == g.to_dict()


def test_quiet_turn_is_kept_with_the_holder_and_round_trips():
    """A quiet request (any rank of the job) makes a quiet turn; it ends with the turn, survives to_dict /
    from_dict, and state stored before the field existed loads as not quiet."""
    g = GroupState("g")
    g.enqueue(TurnRequest("a", "g", world_size=2, rank=0), 1.0)
    g.enqueue(TurnRequest("a", "g", world_size=2, rank=1, quiet=True), 1.1)
    assert g.queue[0].quiet
    back = GroupState.from_dict(g.to_dict())
    assert back.queue[0].quiet
    back.begin_switch(back.queue[0], 0)
    back.complete_grant(2.0)
    assert back.holder_quiet and GroupState.from_dict(back.to_dict()).holder_quiet
    old = back.to_dict()
    del old["holder_quiet"]
    assert GroupState.from_dict(old).holder == "a" and not GroupState.from_dict(old).holder_quiet
    back.release("a", back.token, 0, 3.0)
    assert back.holder_quiet  # one rank still holds the turn
    back.release("a", back.token, 1, 3.0)
    assert not back.holder_quiet
    back.enqueue(TurnRequest("a", "g", world_size=2, rank=0), 4.0)  # the next turn asks for nothing
    stored = back.to_dict()
    del stored["queue"][0]["quiet"]
    assert not GroupState.from_dict(stored).queue[0].quiet


def test_all_ranks_release_before_group_is_free():
    g = GroupState("g")
    _both_ranks(g, "a", 1.0)
    g.begin_switch(g.queue[0], 0)
    g.complete_grant(1.0)
    assert not g.release("a", g.token, 0, 2.0).group_released
    assert g.holder == "a"
    assert g.release("a", g.token, 1, 2.0).group_released
    assert g.holder == ""


def test_rank_that_released_waits_for_the_jobs_next_turn():
    """Rank 0 releases and re-acquires before rank 1 releases: it must not get the
    old turn back; the job queues for its next turn (behind earlier waiters)."""
    g = GroupState("g")
    _both_ranks(g, "a", 1.0)
    g.begin_switch(g.queue[0], 0)
    first = g.complete_grant(1.0)
    g.enqueue(TurnRequest("b", "g"), 1.5)
    g.release("a", first.token, 0, 2.0)
    assert g.enqueue(TurnRequest("a", "g", world_size=2, rank=0), 2.1) is None  # queued, not re-granted
    assert g.enqueue(TurnRequest("a", "g", world_size=2, rank=1), 2.2).token == first.token  # rank 1 still holds
    assert g.release("a", first.token, 1, 2.3).group_released
    assert [w.job_id for w in g.queue] == ["b", "a"]
    assert [w.job_id for w in g.grantable()] == ["b"]  # a's rank 1 has not asked for the next turn yet


def test_residue_of_parked_tenants_counts_against_the_device():
    """On a 3-unit device, c (2 units) fits beside idle a (1 unit) unless parked b left a
    unit behind (a leak it could not park): then a is parked too, before c's restore."""
    def run(leaked: int) -> list[str]:
        g = GroupState("g")
        for job, size in (("a", 1), ("b", 2)):
            g.enqueue(TurnRequest(job, "g", footprint_bytes=size), 1.0)
            assert g.begin_switch(g.queue[0], 3) == []
            g.complete_grant(1.0)
            assert g.release(job, g.token, 0, 2.0).group_released
        g.mark_parked("b", 2, 0.0)  # parked for somebody earlier
        g.tenant("b").residue_bytes = leaked  # as its heartbeat reports after that park
        g.enqueue(TurnRequest("c", "g", footprint_bytes=2), 3.0)
        return g.begin_switch(g.queue[0], 3)

    assert run(0) == []
    assert run(1) == ["a"]
