"""Simulated cluster scale: 100,000 tenants / 10,000 groups over 10 orchestrator replicas, no network.

Three answers, none of them from a live cluster:

* shard balance: groups hashed into --shards shards (``rota_etcd._shards.shard_of``), shards
  assigned to replicas (``rota_etcd._shards.assign``, what the replicas campaign by):
  groups and tenants per replica (min / max / max over mean);
* moves on a replica loss: how many shards and groups change leader when one replica
  dies, next to the floor (the groups the dead replica led): in the assignment, and as
  replicas act (survivors keep their shards, handing over only above their share; each
  of the dead replica's shards goes to its new owner), with the balance after;
* the event rate: one turn per tenant per --period seconds (an Acquire and a Release,
  each a committed state change) needs tenants * 2 / period events/s in all, and the
  busiest replica's share of that. Then the real core state machine
  (``rota.orchestrator.Orchestrator``) runs that replica's share of groups and tenants with
  an in-memory store (``MemoryStore``: a fake of etcd, named so) on one core, every
  tenant taking --rounds turns as fast as it can, to measure the events/s one
  process's engine sustains, and the time to encode a group's state for etcd
  (``rota_etcd._store.encode_state``, paid on every commit) on the states it produced.
  The engine runs on its real clock but never waits on it: turns have zero length.

Writes JSON (default bench/results/scale-sim.json).

    python bench/scale_sim.py [--tenants 100000] [--groups 10000] [--replicas 10] [--shards 240]
                              [--period 10] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import sys
import time

from rota.orchestrator import MemoryStore, Orchestrator, OrchestratorConfig
from rota.types import TurnRequest
from rota_etcd._shards import assign, shard_of
from rota_etcd._store import encode_state


def spread(counts: dict[str, int], replicas: list[str]) -> dict:
    values = [counts.get(r, 0) for r in replicas]
    mean = sum(values) / len(values)
    return {"min": min(values), "max": max(values), "mean": round(mean, 1),
            "max_over_mean": round(max(values) / mean, 3) if mean else None}


async def drive(groups: dict[str, list[str]], rounds: int) -> tuple[int, float, float, list]:
    """Every tenant of every group takes ``rounds`` turns; return (events, wall s, cpu s, group states)."""
    engine = Orchestrator(OrchestratorConfig(), MemoryStore(), name="sim")
    await engine.start()

    async def tenant(job: str, group: str) -> int:
        events = 0
        for _ in range(rounds):
            grant = await engine.acquire(TurnRequest(job_id=job, group_id=group))
            await engine.release(job, group, grant.token)
            events += 2
        return events

    wall, cpu = time.perf_counter(), time.process_time()
    done = await asyncio.gather(*(tenant(j, g) for g, jobs in groups.items() for j in jobs))
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    states = list(engine.groups.values())
    await engine.stop()
    return sum(done), wall, cpu, states


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=100_000)
    ap.add_argument("--groups", type=int, default=10_000)
    ap.add_argument("--replicas", type=int, default=10)
    ap.add_argument("--shards", type=int, default=240)
    ap.add_argument("--period", type=float, default=10.0, help="seconds between one tenant's turns (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="turns per tenant in the engine run (default 3)")
    ap.add_argument("--out", default="bench/results/scale-sim.json")
    ns = ap.parse_args()
    if ns.groups < 1 or ns.tenants < ns.groups or ns.replicas < 2 or ns.shards < ns.replicas or ns.rounds < 1:
        ap.error("need --groups >= 1, --tenants >= --groups, --replicas >= 2, --shards >= --replicas, --rounds >= 1")

    replicas = [f"replica-{i}" for i in range(ns.replicas)]
    groups = [f"group-{i}" for i in range(ns.groups)]
    tenants_of = collections.Counter(i % ns.groups for i in range(ns.tenants))  # tenant i -> group i % groups
    shard = {g: shard_of(g, ns.shards) for g in groups}
    before = assign(ns.shards, replicas)
    group_count = collections.Counter(before[shard[g]] for g in groups)
    tenant_count = collections.Counter()
    for i, g in enumerate(groups):
        tenant_count[before[shard[g]]] += tenants_of[i]

    lost = replicas[0]
    after = assign(ns.shards, replicas[1:])
    moved_shards = [s for s in range(ns.shards) if before[s] != after[s]]
    moved_groups = sum(1 for g in groups if before[shard[g]] != after[shard[g]])
    floor = group_count[lost]
    after_groups = collections.Counter(after[shard[g]] for g in groups)
    # what replicas do (rota_etcd._replica): survivors keep their shards (they hand over only above
    # ceil(shards / replicas)); each of the lost replica's shards goes to its owner in the new assignment
    kept = {s: (after[s] if before[s] == lost else before[s]) for s in range(ns.shards)}
    kept_groups = collections.Counter(kept[shard[g]] for g in groups)

    events_total = ns.tenants * 2 / ns.period
    busiest = max(replicas, key=lambda r: tenant_count[r])
    need = tenant_count[busiest] * 2 / ns.period

    # the busiest replica's share through the real engine (in-memory fake store, one core)
    share = {g: [f"tenant-{i}" for i in range(idx, ns.tenants, ns.groups)]
             for idx, g in enumerate(groups) if before[shard[g]] == busiest}
    events, wall, cpu, states = asyncio.run(drive(share, ns.rounds))
    t0 = time.perf_counter()
    for s in states:
        encode_state(s)
    encode_ms = (time.perf_counter() - t0) * 1000 / max(1, len(states))

    result = {
        "benchmark": "scale-sim", "tenants": ns.tenants, "groups": ns.groups, "replicas": ns.replicas,
        "shards": ns.shards, "cores": os.cpu_count(), "machine": f"{platform.node()} {os.cpu_count()} cpu",
        "python": platform.python_version(),
        "balance": {"groups_per_replica": spread(group_count, replicas),
                    "tenants_per_replica": spread(tenant_count, replicas),
                    "shards_per_replica": spread(collections.Counter(before.values()), replicas)},
        "replica_loss": {"lost": lost, "groups_moved_floor": floor,
                         "assignment": {"shards_moved": len(moved_shards), "groups_moved": moved_groups,
                                        "groups_per_replica_after": spread(after_groups, replicas[1:])},
                         "replicas_keeping_their_shards": {
                             "groups_moved": sum(1 for g in groups if kept[shard[g]] != before[shard[g]]),
                             "groups_per_replica_after": spread(kept_groups, replicas[1:])}},
        "event_rate": {"period_s": ns.period, "events_per_turn": 2, "cluster_events_per_s": round(events_total, 1),
                       "busiest_replica_events_per_s": round(need, 1),
                       "busiest_replica_tenants": tenant_count[busiest], "busiest_replica_groups": len(share)},
        "engine_run": {"store": "MemoryStore (in-memory fake of etcd: no network, no fsync)",
                       "groups": len(share), "tenants": sum(len(v) for v in share.values()), "rounds": ns.rounds,
                       "events": events, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
                       "events_per_cpu_s": round(events / cpu, 1) if cpu else None,
                       "headroom_over_need": round(events / cpu / need, 2) if cpu and need else None,
                       "encode_state_ms_per_commit": round(encode_ms, 4)},
        "note": "assignment and moves come from rota_etcd._shards (what replicas campaign by); the engine run is "
                "the core state machine alone: a real replica also pays gRPC, etcd round trips and "
                "encode_state per commit",
    }
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)
    b, m, e, r = result["balance"], result["replica_loss"], result["event_rate"], result["engine_run"]
    print(f"scale-sim: {ns.tenants} tenants / {ns.groups} groups / {ns.replicas} replicas / {ns.shards} shards: groups "
          f"per replica {b['groups_per_replica']['min']}..{b['groups_per_replica']['max']} (max/mean "
          f"{b['groups_per_replica']['max_over_mean']}); losing one moves {m['assignment']['groups_moved']} groups "
          f"in the assignment, {m['replicas_keeping_their_shards']['groups_moved']} as replicas act (floor "
          f"{m['groups_moved_floor']}); need {e['busiest_replica_events_per_s']:.0f} events/s on the busiest replica; "
          f"its engine alone does {r['events_per_cpu_s']:.0f}/cpu-s ({r['headroom_over_need']}x), encode_state "
          f"{r['encode_state_ms_per_commit']:.3f} ms/commit -> {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
