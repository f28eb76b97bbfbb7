"""Randomized faults: tenants, the orchestrator leader and etcd members are SIGKILLed at random.

Tenant processes loop acquire -> work -> release on two groups against three
orchestrator replicas and a 3-member etcd cluster, while a seeded chaos loop kills a
tenant (and starts a new one), the leader of one group's shard (and restarts it), or
one etcd member (and restarts it). The replicas split the groups into SHARDS shards
(ROTA_ETCD_SHARDS) and the two groups lie in different ones, so leaders of several
shards come and go. Every turn is logged by the tenant that got it; the checker
then proves, per group:

* no two turns overlap in time (a turn ends when its tenant logs the end of its work,
  or when it was killed);
* fencing tokens are unique and grow with grant time;
* no waiter starves: every acquire asked long enough before the end was granted
  (unless its tenant was killed), and the longest wait is reported.

ROTA_FAULT_SEED (default 20240611) and ROTA_FAULT_SECONDS (default 60) reproduce or
lengthen a run. The counts are printed at the end.
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field

import pytest

from rota_etcd._shards import shard_of
from rota_etcd.testing import OrchestratorProcess, shard_leaders

HERE = os.path.dirname(os.path.abspath(__file__))
GROUPS = ("fa", "fb")
TENANTS_PER_GROUP = 3
SHARDS = 4  # "fa" and "fb" lie in shards 0 and 2
STARVE_S = 30.0  # an acquire asked this long before the end must have been granted


@dataclass
class Turn:
    job: str
    group: str
    token: int
    granted: float
    end: float | None = None


@dataclass
class Chaos:
    rng: random.Random
    log: list[str] = field(default_factory=list)
    kills: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    killed_at: dict[str, float] = field(default_factory=dict)  # job -> wall time of SIGKILL
    actions: int = 0

    def note(self, what: str) -> None:
        self.log.append(f"{time.time():.6f} {what}")


class Tenants:
    def __init__(self, tmp_path, endpoint: str, env: dict[str, str]) -> None:
        self.folder = tmp_path / "tenants"
        self.folder.mkdir()
        self.endpoint, self.env = endpoint, env
        self.procs: dict[str, subprocess.Popen] = {}
        self.generation = 0

    def spawn(self, group: str, slot: int) -> str:
        self.generation += 1
        job = f"{group}-s{slot}-g{self.generation}"
        with open(self.folder / f"{job}.err", "w") as err:
            self.procs[job] = subprocess.Popen(
                [sys.executable, os.path.join(HERE, "etcd_tenant.py"), "--endpoint", self.endpoint, "--group", group,
                 "--job", job, "--log", str(self.folder / f"{job}.log"), "--seed", str(self.generation)],
                env=self.env, stdout=subprocess.DEVNULL, stderr=err)
        return job

    def kill(self, job: str) -> float:
        p = self.procs.pop(job)
        os.kill(p.pid, signal.SIGKILL)
        at = time.time()
        p.wait(10)
        return at


def read_logs(folder) -> tuple[list[Turn], list[tuple[str, str, float]], int]:
    """Turns, acquires never granted (job, group, asked_at), and release errors."""
    turns: list[Turn] = []
    open_asks: list[tuple[str, str, float]] = []
    release_errors = 0
    for path in sorted(folder.glob("*.log")):
        current: dict[int, Turn] = {}
        asked: tuple[str, str, float] | None = None
        for line in path.read_text().splitlines():
            kind, job, group, *rest = line.split()
            if kind == "ask":
                asked = (job, group, float(rest[0]))
            elif kind == "grant":
                turn = Turn(job, group, int(rest[0]), float(rest[1]))
                turns.append(turn)
                current[turn.token] = turn
                asked = None
            elif kind == "end":
                current[int(rest[0])].end = float(rest[1])
            elif kind == "error" and rest[0] == "release":
                release_errors += 1
        if asked is not None:
            open_asks.append(asked)
    return turns, open_asks, release_errors


def check(turns: list[Turn], open_asks: list, chaos: Chaos, run_end: float) -> list[str]:
    violations: list[str] = []
    by_group: dict[str, list[Turn]] = defaultdict(list)
    for t in turns:
        if t.end is None:  # killed while holding, or still holding at the end
            t.end = chaos.killed_at.get(t.job, run_end)
        by_group[t.group].append(t)
    for group, ts in by_group.items():
        tokens = [t.token for t in ts]
        if len(set(tokens)) != len(tokens):
            violations.append(f"{group}: a token was granted twice")
        ts.sort(key=lambda t: t.token)
        for a, b in itertools.pairwise(ts):
            if b.granted < a.granted:
                violations.append(f"{group}: token {b.token} granted before token {a.token}")
            if b.granted < a.end:
                violations.append(f"{group}: token {b.token} ({b.job}) granted at {b.granted:.3f} while token "
                                  f"{a.token} ({a.job}) held until {a.end:.3f}")
    for job, group, asked in open_asks:
        if job not in chaos.killed_at and asked < run_end - STARVE_S:
            violations.append(f"{group}: {job} asked at {asked:.3f} and was never granted")
    return violations


@pytest.mark.slow
def test_random_kills_of_tenants_leader_and_etcd_members_never_break_mutual_exclusion(
        etcd3, tmp_path, child_env, prefix, capsys) -> None:
    seed = int(os.environ.get("ROTA_FAULT_SEED", "20240611"))
    seconds = float(os.environ.get("ROTA_FAULT_SECONDS", "60"))
    chaos = Chaos(random.Random(seed))
    child_env = dict(child_env, ROTA_ETCD_SHARDS=str(SHARDS))
    assert len({shard_of(g, SHARDS) for g in GROUPS}) == len(GROUPS)
    orchs = [OrchestratorProcess(etcd3.url, tmp_path / f"orch{i}.log", args=["--ttl", "3"], env=child_env)
             for i in range(3)]
    for o in orchs:
        o.start()
    tenants = Tenants(tmp_path, ",".join(o.endpoint for o in orchs), child_env)
    slots = {(g, s): tenants.spawn(g, s) for g in GROUPS for s in range(TENANTS_PER_GROUP)}
    etcd_down: tuple[int, float] | None = None  # (member, restart at)
    orch_down: tuple[OrchestratorProcess, float] | None = None
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            time.sleep(chaos.rng.uniform(1.0, 2.5))
            now = time.monotonic()
            if etcd_down and now >= etcd_down[1]:
                etcd3.restart(etcd_down[0])
                chaos.note(f"restarted etcd member {etcd_down[0]}")
                etcd_down = None
            if orch_down and now >= orch_down[1]:
                orch_down[0].start()
                chaos.note(f"restarted orchestrator {orch_down[0].endpoint}")
                orch_down = None
            kind = chaos.rng.choice(["tenant", "tenant", "leader", "etcd"])
            chaos.actions += 1
            if kind == "tenant":
                (group, slot), job = chaos.rng.choice(sorted(slots.items()))
                chaos.killed_at[job] = tenants.kill(job)
                slots[(group, slot)] = tenants.spawn(group, slot)
                chaos.note(f"killed tenant {job}; started {slots[(group, slot)]}")
            elif kind == "leader" and orch_down is None:
                address = shard_leaders(etcd3.url, prefix).get(shard_of(chaos.rng.choice(GROUPS), SHARDS))
                leader = next((o for o in orchs if address == o.endpoint and o.running), None)
                if leader is None:
                    continue
                leader.kill(signal.SIGKILL)
                chaos.note(f"killed leader {leader.endpoint}")
                orch_down = (leader, now + chaos.rng.uniform(1.0, 3.0))
            elif kind == "etcd" and etcd_down is None:
                member = chaos.rng.randrange(len(etcd3.members))
                etcd3.kill(member)
                chaos.note(f"killed etcd member {member}")
                etcd_down = (member, now + chaos.rng.uniform(1.0, 4.0))
            else:
                continue
            chaos.kills[kind] += 1
        if etcd_down:
            etcd3.restart(etcd_down[0])
        if orch_down:
            orch_down[0].start()
        time.sleep(2.0)  # let the last waiters through
    finally:
        run_end = time.time()
        for job in list(tenants.procs):
            chaos.killed_at.setdefault(job, tenants.kill(job))
        for o in orchs:
            o.stop()

    (tmp_path / "chaos.log").write_text("\n".join(chaos.log) + "\n")
    turns, open_asks, release_errors = read_logs(tenants.folder)
    violations = check(turns, open_asks, chaos, run_end)
    waits = sorted(w for w in _waits(tenants.folder))
    report = {
        "seed": seed, "seconds": seconds, "trials": chaos.actions, "kills": dict(chaos.kills),
        "grants": len(turns), "tenants": tenants.generation, "revoked_turns": release_errors,
        "max_wait_s": round(waits[-1], 3) if waits else 0.0, "violations": len(violations),
    }
    with capsys.disabled():
        print(f"\nrota-etcd fault test: {json.dumps(report)}")
    assert not violations, "\n".join(violations[:20])
    assert len(turns) > 100, f"only {len(turns)} grants: the run did not exercise much"
    assert chaos.kills["leader"] and chaos.kills["etcd"] and chaos.kills["tenant"], chaos.kills
    assert release_errors == 0, f"{release_errors} live tenants lost their turn (see tenant logs)"


def _waits(folder) -> list[float]:
    out = []
    for path in folder.glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if parts[0] == "grant":
                out.append(float(parts[4]) - float(parts[5]))
    return out


def test_the_checker_catches_overlaps_reused_or_reordered_tokens_and_starvation() -> None:
    chaos = Chaos(random.Random(0))
    chaos.killed_at["dead"] = 12.0
    good = [Turn("a", "g", 1, 10.0, 11.0), Turn("dead", "g", 2, 11.5, None), Turn("b", "g", 3, 12.5, 13.0)]
    assert check(good, [], chaos, run_end=100.0) == []
    overlap = [Turn("a", "g", 1, 10.0, 11.0), Turn("b", "g", 2, 10.5, 12.0)]
    assert "while token 1 (a) held until" in check(overlap, [], chaos, 100.0)[0]
    killed_overlap = [Turn("dead", "g", 1, 10.0, None), Turn("b", "g", 2, 11.0, 11.5)]  # granted before the kill
    assert check(killed_overlap, [], chaos, 100.0)
    reused = [Turn("a", "g", 1, 10.0, 11.0), Turn("b", "g", 1, 12.0, 13.0)]
    assert any("granted twice" in v for v in check(reused, [], chaos, 100.0))
    reordered = [Turn("a", "g", 2, 10.0, 11.0), Turn("b", "g", 3, 9.0, 9.5)]
    assert any("granted before" in v for v in check(reordered, [], chaos, 100.0))
    assert check([], [("c", "g", 50.0)], chaos, run_end=100.0)  # asked 50 s before the end, never granted
    assert not check([], [("c", "g", 90.0)], chaos, run_end=100.0)
    assert not check([], [("dead", "g", 1.0)], chaos, run_end=100.0)
