"""A group over several devices: one lane (a :class:`GroupState`) per device, placed by :mod:`rota.placement`.

Each lane keeps every rule of a group: one holder, a queue, residents, a fencing token that
grows. So no device is ever granted twice. A job is in at most one lane at a time: it is
queued (or holds, or is resident) in the lane :func:`choose_lane` placed its turn in; when
its state moves to another device the old lane forgets it, counting its bytes as left behind
(``residue_bytes``) until its turn on the new device has ended (the move is done by then); a
grant on the old device that needs those bytes waits for that (:func:`grant_waits_for_move`).

Functions here change lanes in memory only; the orchestrator (:mod:`rota._orchestrator.turns`) calls
them under the group's one lock and commits what they changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rota._orchestrator.state import GONE, GroupState
from rota.devices import LANE_SEP, lane_base, lane_device, lane_id
from rota.placement import Choice, DeviceView, evict_plan, place


def lanes_of(groups: dict[str, GroupState], base: str) -> dict[str, GroupState]:
    """device -> lane of group ``base``."""
    prefix = base + LANE_SEP
    return {lane_device(gid): g for gid, g in groups.items() if gid.startswith(prefix)}


def in_use(g: GroupState) -> bool:
    """Whether a job holds, switches into, waits for or is resident on ``g`` now (a lane or a plain group): only
    then does it decide whether the group's tenants name devices. A lane everyone left decides nothing."""
    return bool(g.holder or g.switching_to or g.queue or g.residents)


def emptied(g: GroupState) -> bool:
    """A lane nobody is in any more (no turn, waiter, resident or parked state): it goes with its last job."""
    return not in_use(g) and all(rec.state in ("idle", "lost", "ended") for rec in g.tenants.values())


def is_lane(group_id: str) -> bool:
    return LANE_SEP in group_id


def _has_turn(g: GroupState, job_id: str) -> bool:
    """Whether ``job_id`` holds ``g`` or a switch hands it ``g`` now."""
    return g.holder == job_id or g.switching_to == job_id


def _in_turn(g: GroupState, job_id: str) -> bool:
    """Whether ``job_id`` holds, switches in or waits on ``g``: its next (or current) turn is there."""
    return _has_turn(g, job_id) or g.queued(job_id) is not None


def waiting_jobs(lanes: dict[str, GroupState]) -> set[str]:
    """Jobs queued in any lane: their next turns need their state."""
    return {w.job_id for g in lanes.values() for w in g.queue}


def lane_with(groups: dict[str, GroupState], base: str, job_id: str) -> GroupState | None:
    """The lane where ``job_id`` holds, switches in, waits, is resident or parked; None if none."""
    found = None
    for g in lanes_of(groups, base).values():
        if _in_turn(g, job_id):
            return g
        rec = g.tenants.get(job_id)
        if rec is not None and (job_id in g.residents or rec.state == "parked"):
            found = g
    return found


def choose_lane(groups: dict[str, GroupState], base: str, job_id: str, devices: tuple[str, ...], need: int,
                capacity: int) -> tuple[str, str, Choice | None]:
    """(lane id, lane the job's state leaves or "", the placement) for the job's next turn.

    A job already queued, switching in or holding somewhere stays there (an acquire is
    idempotent). Otherwise :func:`rota.placement.place` decides; if the state is elsewhere,
    that lane forgets the job now (its bytes still count there as residue until the move).
    """
    lanes = lanes_of(groups, base)
    for dev, g in lanes.items():
        if _in_turn(g, job_id):
            return lane_id(base, dev), "", None
    home = next((d for d, g in lanes.items() if job_id in g.residents), "")
    parked_on = next((d for d, g in lanes.items() if job_id in g.tenants and g.tenants[job_id].state == "parked"), "")
    if not need:
        need = max((g.tenants[job_id].footprint_bytes for g in lanes.values() if job_id in g.tenants), default=0)
    views = []
    for dev in devices:
        g = lanes.get(dev)
        if g is None:
            views.append(DeviceView(dev, capacity=capacity))
            continue
        views.append(DeviceView(dev, busy=bool(g.holder or g.switching_to or g.queue), queue=len(g.queue),
                                residents={j: g.tenant(j).footprint_bytes for j in g.residents if j != job_id},
                                capacity=capacity, residue=g.residue_off(job_id), holder=g.holder))
    choice = place(job_id, need, views, home=home if home in devices else "", waiting=waiting_jobs(lanes))
    source = home or parked_on
    if source and source != choice.device:
        old = lanes[source]
        rec = old.tenant(job_id)
        resident, nbytes = job_id in old.residents, rec.footprint_bytes
        old.remove(job_id, time.monotonic(), lost=False)
        rec.residue_bytes = nbytes if resident else 0  # still on the old device until its move is done
        return lane_id(base, choice.device), lane_id(base, source), choice
    return lane_id(base, choice.device), "", choice


def steal(groups: dict[str, GroupState], lane: GroupState, capacity: int, now: float) -> tuple[str, str] | None:
    """An idle ``lane`` takes a waiter of a busy lane that may run on its device and fits there without parking
    anyone (the earliest to arrive); returns (job, the lane it left), or None.

    Placement happens when a job asks; a job that then waits behind its device's holder
    would wait on while another device idles. Its state, if resident on the busy device,
    moves (it counts there as residue until its turn here ends), as :func:`choose_lane` does.
    A waiter whose grant waits for a state moving out of its device (:func:`grant_waits_for_move`)
    is taken too, though its lane has no holder: it would wait there for another job's whole turn.
    """
    if lane.holder or lane.switching_to or lane.queue:
        return None
    device = lane_device(lane.group_id)
    resident = {j: lane.tenant(j).footprint_bytes for j in lane.residents}
    found = []
    for old in lanes_of(groups, lane_base(lane.group_id)).values():
        if old is lane:
            continue
        busy = bool(old.holder or old.switching_to)
        for w in old.grantable():
            need = old.tenant(w.job_id).footprint_bytes
            if w.job_id == old.switching_to or w.world_size > 1 or device not in w.devices:
                continue
            if not busy and not grant_waits_for_move(groups, old, w.job_id, capacity):
                continue  # an idle lane grants its own waiters
            view = DeviceView(device, residents=resident, capacity=capacity, residue=lane.residue_off(w.job_id))
            if view.fits(need):
                found.append((w.arrived, w.seq, old, w))
    if not found:
        return None
    _, _, old, w = min(found, key=lambda f: (f[0], f[1]))
    rec = old.tenant(w.job_id)
    moves_state = w.job_id in old.residents or rec.state == "parked"
    nbytes, was_resident = rec.footprint_bytes, w.job_id in old.residents
    old.remove(w.job_id, now, lost=False)
    rec.residue_bytes = nbytes if was_resident else 0
    mine = lane.tenant(w.job_id)
    mine.priority, mine.weight, mine.world_size, mine.footprint_bytes = rec.priority, rec.weight, 1, nbytes
    mine.state, mine.last_active = "parked" if moves_state else "waiting", now
    lane.seq += 1
    w.seq = lane.seq
    lane.queue.append(w)
    return w.job_id, old.group_id


def left_behind(groups: dict[str, GroupState], lane: GroupState, job_id: str) -> list[GroupState]:
    """The other lanes of ``lane``'s group where ``job_id``'s bytes still count as residue (its state moves out).

    A grant there may wait for that move (:func:`grant_waits_for_move`): drive them again whenever
    ``job_id``'s turn on ``lane`` ends, however it ends.
    """
    return [g for g in lanes_of(groups, lane_base(lane.group_id)).values()
            if g is not lane and job_id in g.tenants and g.tenants[job_id].residue_bytes and job_id not in g.residents]


def moved_in(groups: dict[str, GroupState], lane: GroupState, job_id: str) -> list[GroupState]:
    """``job_id`` ended a turn on ``lane``: its state left every other lane. Returns lanes changed."""
    changed = left_behind(groups, lane, job_id)
    for g in changed:
        g.tenants[job_id].residue_bytes = 0
    return changed


def _moving_out(lanes: dict[str, GroupState], lane: GroupState, incoming: str) -> dict[str, GroupState]:
    """Jobs whose residue counts on ``lane`` (as :meth:`GroupState.residue_off` ``incoming``) and whose turn is in
    another lane -> that lane: their bytes leave ``lane`` at :func:`moved_in`."""
    moving = {}
    for job, rec in lane.tenants.items():
        if job != incoming and rec.residue_bytes and job not in lane.residents and rec.state not in GONE:
            there = next((g for g in lanes.values() if g is not lane and _in_turn(g, job)), None)
            if there is not None:
                moving[job] = there
    return moving


def grant_waits_for_move(groups: dict[str, GroupState], lane: GroupState, job_id: str, capacity: int) -> bool:
    """Whether granting ``job_id`` on ``lane`` must wait for a state still moving out of the device.

    It must when ``job_id`` would not fit even with every resident parked, and some of the residue
    in the way is the state of a job whose turn is in another lane now (held or waited for): those
    bytes leave at that job's :func:`moved_in`, which drives ``lane`` again; granted now, the device
    would be over-committed. Residue nobody moves (a leak, a job that left) is granted over, as
    before: nothing would clear it. Nor does a grant wait for a job that waits in a lane whose own
    residue moves to a job that waits too: two lanes could then wait on each other for ever.
    """
    if capacity <= 0 or not is_lane(lane.group_id) or \
            lane.tenant(job_id).footprint_bytes + lane.residue_off(job_id) <= capacity:
        return False  # nothing in the way, or parking residents makes room
    lanes = lanes_of(groups, lane_base(lane.group_id))
    return any(_has_turn(there, job) or all(_has_turn(g, j) for j, g in _moving_out(lanes, there, "").items())
               for job, there in _moving_out(lanes, lane, job_id).items())


def evict_chooser(groups: dict[str, GroupState], lane: GroupState, capacity: int
                  ) -> Callable[[dict[str, int], int, int], list[str] | None]:
    """What a switch in ``lane`` parks: the cheapest residents, counting who waits (:func:`evict_plan`)."""
    waiting = waiting_jobs(lanes_of(groups, lane_base(lane.group_id)))

    def choose(residents: dict[str, int], need: int, residue: int) -> list[str] | None:
        return evict_plan(residents, need, capacity, residue=residue, waiting=waiting)

    return choose
