"""A group's driver: switches (parking residents, by their sessions or agents, before a grant) and prefetch.

Agents (rota-agent, ``snapshot_agent.v1alpha1``): with ``OrchestratorConfig.agents``
(``--agent`` / ``ROTA_AGENTS``), a switch first asks every agent's ``Status`` which of
the jobs involved it knows. A job registered with an agent is parked by that agent
(``Snapshot``, then ``GetOperation`` until done) instead of through its rota session,
and an incoming job that was parked and is registered with an agent is restored by it
(``Restore``) *at the same time* as the outgoing jobs are parked, before its grant.
A failed or timed-out agent operation FAULTs that job and the group moves on.

Prefetch (``OrchestratorConfig.prefetch``, on by default when ``capacity_bytes`` is
known): while a holder runs, the job the policy would grant next is restored early if
it is parked and fits (all footprints known), through its agent or through its sessions
(when the tenant's client can restore on command). To make room it parks idle residents
first, oldest first as a switch would, so both directions of the switch happen during
the holder's turn; it never parks the holder or a job that is waiting for a turn. At
most one prefetch per group runs at a time, and the group's driver
waits for it before it starts a switch, so a grant never races a prefetch's restore
and never starts a second one. A failed prefetch is handled like a failed restore of
the same kind: by an agent, the job is FAULTED; by the tenant, it stays parked (and its
client restores it at its grant, as without prefetch).

A quiet turn (``TurnRequest.quiet``, ``gpu.turn(quiet=True)``) starts no prefetch while
it is held: its job needs the device's memory to stay as it is (an inference engine
profiles free memory as it starts). None is in flight when it begins either: a prefetch
starts only while a holder holds the group and no switch runs, and a grant waits for one
in flight (here, and ``_grant_at_once`` declines while one runs).

:class:`GroupDriver` is that part of :class:`~rota._orchestrator.turns.Orchestrator` (a
mixin: the state it uses is made by ``Orchestrator.__init__``).
"""

from __future__ import annotations

import asyncio
import logging
import time

from rota._orchestrator import lanes as _lanes
from rota._orchestrator.futures import fail
from rota._orchestrator.state import GONE, GroupState
from rota.devices import lane_base, lane_device
from rota.errors import Faulted, RotaError

log = logging.getLogger(__name__)


class GroupDriver:
    """The switching part of the orchestrator (a mixin of :class:`~rota._orchestrator.turns.Orchestrator`)."""

    def _kick(self, group_id: str) -> None:
        task = self._drivers.get(group_id)
        if task is None or task.done():
            self._drivers[group_id] = asyncio.create_task(self._drive(group_id))

    def _kick_left_behind(self, g: GroupState, job_id: str) -> None:
        """``job_id``'s turn on ``g`` is over without its move (it left or faulted): drive the lanes its state was
        moving out of, whose grants may wait for it (:func:`.lanes.grant_waits_for_move`)."""
        for other in _lanes.left_behind(self.groups, g, job_id):
            self._kick(other.group_id)

    async def _drive(self, group_id: str) -> None:
        """Grant the group to waiters, one after another, parking residents first."""
        while True:
            inflight = self._prefetching.get(group_id)
            if inflight is not None:  # let it finish: its job is then resident (or still parked), never half-way
                await asyncio.wait({inflight[1]})
                continue
            async with self._lock(group_id):
                g = self.groups.get(group_id)
                if g is not None and _lanes.is_lane(group_id) and not g.ready_for_grant():
                    await self._steal(g)  # an idle device takes a waiter another device's holder keeps waiting
                if g is None or not g.ready_for_grant():
                    if g is not None:
                        self._maybe_prefetch(g)
                    return
                chosen = self.config.policy.choose(g.grantable(), g.tenants, time.monotonic())
                if chosen is None:  # the policy holds the waiters back for now (e.g. resident-first)
                    recheck = float(getattr(self.config.policy, "recheck_s", 0.25))
                    asyncio.get_running_loop().call_later(recheck, self._kick, group_id)
                    self._maybe_prefetch(g)
                    return
                if _lanes.grant_waits_for_move(self.groups, g, chosen.job_id, self.config.capacity_bytes):
                    return  # a state moving out is in the way; its move's end (or its job's leaving) kicks us
                evict = self._begin_switch(g, chosen)
                others = [j for j in g.residents if j != chosen.job_id]
                incoming_parked = g.tenant(chosen.job_id).state == "parked"
            located: dict[str, str] = {}
            if self.agents is not None:  # which jobs an agent parks/restores (outside the lock)
                located = await self.agents.locate({*others, chosen.job_id})
                if not self.config.capacity_bytes:  # footprint unknown to us: park every agent-held resident
                    evict += [j for j in others if j in located and j not in evict]
            evict = [j for j in evict if j in located or self._live_sessions((group_id, j))]
            steps = [self._park(group_id, j, g.token, located.get(j, "")) for j in evict]
            restore_agent = located.get(chosen.job_id, "") if incoming_parked else ""
            if restore_agent:  # overlapped with the parks: both directions of PCIe at once
                steps.append(self.agents.run(restore_agent, "restore", chosen.job_id, group_id))  # type: ignore[union-attr]
            results = await asyncio.gather(*steps)
            async with self._lock(group_id):
                self._record_parks(g, evict, results)
                if restore_agent and self.metrics is not None:
                    self.metrics.restored(group_id, results[-1][0], results[-1][3])
                if restore_agent and not results[-1][0]:
                    error = results[-1][1]
                    log.error("restore of job %s in group %s by agent %s failed: %s; job FAULTED",
                              chosen.job_id, group_id, restore_agent, error)
                    g.tenant(chosen.job_id).restores_failed += 1
                    self._fault(g, chosen.job_id, f"restore by agent {restore_agent} failed: {error}",
                                f"restore of job {chosen.job_id!r} in group {group_id!r} failed: {error}; acquire "
                                "again to retry")
                    await self.store.commit(g)
                if g.switching_to != chosen.job_id or g.queued(chosen.job_id) is None:
                    g.abort_switch()
                    continue
                grant = g.complete_grant(time.monotonic(), prefetch=self.config.prefetch_on)
                if self.metrics is not None:
                    self.metrics.granted(group_id, grant.waited_ms / 1000.0)
                try:
                    await self.store.commit(g)
                except RotaError as exc:  # not durable: undo nothing visible, fail the waiter
                    log.error("could not commit grant of %s to %s: %s", grant.job_id, group_id, exc)
                    self._settle((group_id, grant.job_id), exc)
                    return
                self._settle((group_id, grant.job_id), grant)

    async def _steal(self, lane: GroupState) -> None:
        """Under the lock: idle ``lane`` takes a waiter of a busy lane that fits here (:func:`.lanes.steal`);
        its pending acquire now waits for this lane."""
        stolen = _lanes.steal(self.groups, lane, self.config.capacity_bytes, time.monotonic())
        if stolen is None:
            return
        job, left = stolen
        fut = self._grants.pop((left, job), None)
        if fut is not None:
            self._grants[(lane.group_id, job)] = fut
        await self.store.commit(self.groups[left])
        await self.store.commit(lane)
        log.info("job %s in group %s: waited for %s, moves to idle %s", job, lane_base(lane.group_id),
                 lane_device(left), lane_device(lane.group_id))

    async def agent_job_states(self, group_id: str) -> list[tuple[str, str, str]]:
        """(agent, JobState name, job) for every job of ``group_id`` that an agent knows."""
        if self.agents is None:
            return []
        g = self.groups.get(group_id)
        jobs = set(g.tenants) if g is not None else set()
        return [t for t in await self.agents.job_states() if t[2] in jobs]

    def _maybe_prefetch(self, g: GroupState) -> None:
        """Start restoring the job the policy would grant next, if it is parked and fits
        beside every resident, unless the holder's turn is quiet. Called by the group's driver,
        under the group's lock."""
        if not self.config.prefetch_on or not g.holder or g.holder_quiet or not g.grantable() \
                or g.group_id in self._prefetching \
                or _lanes.is_lane(g.group_id):  # a lane's prefetch would restore on the device it left: none yet
            return
        chosen = self.config.policy.choose(g.grantable(), g.tenants, time.monotonic())
        if chosen is None:
            return
        job = chosen.job_id
        if (g.group_id, job, g.token) in self._prefetch_failed or \
                g.prefetch_plan(job, self.config.capacity_bytes) is None:
            return
        self._prefetch_failed = {k for k in self._prefetch_failed if k[0] != g.group_id or k[2] == g.token}
        task = asyncio.create_task(self._prefetch(g.group_id, job))
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # logged inside; never "unretrieved"
        self._prefetching[g.group_id] = (job, task)

    async def _prefetch(self, group_id: str, job_id: str) -> None:
        """Restore ``job_id`` ahead of its grant (agent or sessions); RPCs run outside the lock."""
        capacity = self.config.capacity_bytes
        try:
            async with self._lock(group_id):
                plan = self.groups[group_id].prefetch_plan(job_id, capacity) or []
            located = await self.agents.locate({job_id, *plan}) if self.agents is not None else {}
            agent = located.get(job_id, "")
            async with self._lock(group_id):
                g = self.groups[group_id]
                sessions = self._live_sessions((group_id, job_id))
                by_session = bool(sessions) and all(s.can_prefetch for s in sessions)
                plan = g.prefetch_plan(job_id, capacity)  # type: ignore[assignment]
                if not (agent or by_session) or plan is None or \
                        not all(j in located or self._live_sessions((group_id, j)) for j in plan):
                    return  # nobody can restore it early or park what is in the way, or it no longer fits / waits
                token = g.token
                log.info("prefetch: restoring job %s in group %s while %s holds it (%s)%s", job_id, group_id,
                         g.holder or "nobody", f"agent {agent}" if agent else "its client",
                         f", after parking idle {plan}" if plan else "")
            if plan:  # make room first: idle residents go to the host during the holder's turn too
                results = await asyncio.gather(*(self._park(group_id, j, token, located.get(j, "")) for j in plan))
                async with self._lock(group_id):
                    g = self.groups[group_id]
                    self._record_parks(g, plan, results)
                    await self.store.commit(g)
                    if g.prefetch_plan(job_id, capacity) != []:
                        return  # still no room (a park failed, or things changed): the grant will switch
            if agent:
                ok, error, _, seconds = await self.agents.run(agent, "restore", job_id, group_id)  # type: ignore[union-attr]
            else:
                ok, error, _, seconds = await self._session_command(group_id, job_id, "restore", token)
            if self.metrics is not None:
                self.metrics.restored(group_id, ok, seconds)
            async with self._lock(group_id):
                self._prefetched(self.groups[group_id], job_id, agent, ok, error, seconds)
                await self.store.commit(self.groups[group_id])
        except asyncio.CancelledError:
            log.info("prefetch of job %s in group %s cancelled (the job ended)", job_id, group_id)
        except Exception:  # a bug here must not stall the group: its driver waits for this task
            log.exception("prefetch of job %s in group %s failed unexpectedly; it stays parked", job_id, group_id)
        finally:
            if self._prefetching.get(group_id, ("", None))[1] is asyncio.current_task():
                del self._prefetching[group_id]

    def _record_parks(self, g: GroupState, jobs: list[str], results: list[tuple[bool, str, int, float]]) -> None:
        """Record finished parks (under the lock): parked, or FAULTED with the cause; extra results are ignored.

        A faulted job leaves the queue, so an acquire it has pending there (a resident
        waits for its next turn while others run) fails with the cause instead of
        waiting for a grant that can no longer come; acquiring again retries.
        """
        for job, (ok, error, nbytes, seconds) in zip(jobs, results, strict=False):
            if self.metrics is not None:
                self.metrics.parked(g.group_id, ok, nbytes, seconds)
            if ok:
                g.mark_parked(job, nbytes, seconds)
                continue
            log.error("park of job %s in group %s failed: %s; job FAULTED", job, g.group_id, error)
            g.tenant(job).parks_failed += 1
            self._fault(g, job, f"park failed: {error}", f"park of job {job!r} in group {g.group_id!r} failed: "
                        f"{error}; its state was left in place; acquire again to retry")

    def _fault(self, g: GroupState, job_id: str, cause: str, message: str) -> None:
        """Take a job out of the group as FAULTED with ``cause`` (under the lock), and fail an
        acquire it has pending with ``message``: FAULTED is retryable by acquiring again."""
        g.remove(job_id, time.monotonic(), lost=True)
        g.tenant(job_id).state, g.tenant(job_id).fault = "faulted", cause
        self._kick_left_behind(g, job_id)
        fut = self._grants.pop((g.group_id, job_id), None)
        if fut is not None and not fut.done():
            fail(fut, Faulted(message, job_id=job_id, group_id=g.group_id))

    def _prefetched(self, g: GroupState, job_id: str, agent: str, ok: bool, error: str, seconds: float) -> None:
        """Record a prefetch's outcome (under the lock), as a restore of the same kind would."""
        rec = g.tenant(job_id)
        if rec.state in ("faulted", *GONE):
            log.info("prefetch of job %s in group %s ignored: the job is %s", job_id, g.group_id, rec.state)
            return
        if ok:
            if g.queued(job_id) is not None:
                g.mark_prefetched(job_id)
            else:  # left the queue while its restore ran, but it is alive and on the device now
                if job_id not in g.residents:
                    g.residents.append(job_id)
                rec.state = "resident"
            log.info("prefetch: job %s in group %s restored in %.3f s, before its grant", job_id, g.group_id, seconds)
            return
        g.prefetch_failures += 1
        rec.restores_failed += 1
        self._prefetch_failed.add((g.group_id, job_id, g.token))
        if not agent:  # the client rolled its restore back: still parked; it restores itself at its grant
            log.warning("prefetch of job %s in group %s failed: %s; it stays parked", job_id, g.group_id, error)
            return
        log.error("prefetch of job %s in group %s by agent %s failed: %s; job FAULTED", job_id, g.group_id, agent,
                  error)
        self._fault(g, job_id, f"restore (prefetch) by agent {agent} failed: {error}",
                    f"restore of job {job_id!r} in group {g.group_id!r} failed: {error}; acquire again to retry")

    async def _park(self, group_id: str, job_id: str, token: int, agent: str = "") -> tuple[bool, str, int, float]:
        """Ask every rank of a resident job to park (or its agent); wait for all acknowledgements."""
        if agent and self.agents is not None:
            return await self.agents.run(agent, "snapshot", job_id, lane_base(group_id))
        return await self._session_command(group_id, job_id, "park", token)


__all__ = ["GroupDriver"]
