"""Scale: many tenants over many groups against 1, 2 and 3 etcd-backed orchestrator replicas.

1,000 tenants (default) share 100 groups, 10 per group. Worker processes drive them as
asyncio tasks speaking rota.v1 Acquire/Release over gRPC (no sessions, like v1alpha1
clients) against `rota orchestrator serve --etcd` replicas with ROTA_ETCD_SHARDS
shards (each replica leads its share) and one etcd member on loopback. A worker sends
a group's calls to the replica it last learnt leads it (the `rota-leader` trailer of a
redirect) and caches that. Each run has two phases:

* burst: every tenant asks at the same moment, once; acquire latency (ask -> grant,
  queueing behind the group's other tenants included) and grants/s until all are done;
* steady: for --seconds, every tenant loops acquire -> release; grants/s and acquire
  latency. Meanwhile one probe tenant per worker, alone in its own group, loops too:
  its acquire latency is what a tenant whose GPU is free waits under that load.
  --turn-ms makes every tenant hold its turn that long (default 0: turns back to back,
  a closed loop that saturates the replicas, so every latency is then mostly backlog).

Runs: --replicas (default 1,2,3), then with --kill the largest count again, killing
(SIGKILL) the replica that leads the first probe's shard halfway through the steady
phase: how long until each of its groups grants again (target < 2x the leader lease
TTL) and whether any group ever had two holders at once (client-side grant..release
intervals of one group overlapping, or one token granted twice: must be 0).

Each run also reports the replicas' memory per tenant (RSS growth from before the tenants came to the end)
and the load average (the cores may be shared). Writes JSON (default bench/results/scale-etcd-cpu.json) with
the machine's core count.

    python bench/scale.py [--tenants 1000] [--groups 100] [--workers 4] [--seconds 20] [--replicas 1,2,3]
                          [--shards 12] [--leader-ttl 5] [--turn-ms 0] [--kill] [--profile SVG]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time

from rota._units import percentile
from rota.testing import free_port


async def worker(endpoints: list[str], tenants: list[tuple[str, str]], start_at: float, seconds: float,
                 probe: str, hold_s: float = 0.0) -> dict:
    import grpc

    from rota.wire import rota_v1_pb2 as pb
    from rota.wire import rota_v1_pb2_grpc as pb_grpc

    channels = {e: grpc.aio.insecure_channel(e) for e in endpoints}
    stubs = {e: pb_grpc.RotaServiceStub(ch) for e, ch in channels.items()}
    where: dict[str, str] = {}  # group -> the replica that last said it leads it
    redirects = [0]

    async def call(method: str, req, group: str, tries: list[int] | None = None):
        while True:
            if tries is not None:
                tries[0] += 1
            ep = where.setdefault(group, endpoints[hash(group) % len(endpoints)])
            try:
                return await getattr(stubs[ep], method)(req, timeout=120)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                leader = dict(exc.trailing_metadata() or ()).get("rota-leader", "")
                redirects[0] += 1
                if leader in stubs and leader != ep:
                    where[group] = leader
                else:  # no leader known there (election) or the replica is gone: try the next one
                    where[group] = endpoints[(endpoints.index(ep) + 1) % len(endpoints)]
                    await asyncio.sleep(0.05)

    turns: list[tuple[str, str, int, float, float, float]] = []  # group, job, token, asked, granted, released
    release_errors: list[str] = []

    acquire_timeouts = [0]
    released_before = [0]

    async def turn(job: str, group: str) -> float | None:
        asked, t0 = time.time(), time.perf_counter()
        try:
            grant = await call("Acquire", pb.TurnRequest(job_id=job, group_id=group), group)
        except grpc.aio.AioRpcError as exc:  # not granted within 120 s: counted, and the tenant asks again
            if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                raise
            acquire_timeouts[0] += 1
            return None
        took = time.perf_counter() - t0
        granted = time.time()
        if hold_s:
            await asyncio.sleep(hold_s)  # the tenant uses its turn
        released = time.time()  # when the Release is first sent (the turn ends after it)
        tries = [0]
        try:
            await call("Release", pb.ReleaseRequest(job_id=job, group_id=group, token=grant.token), group, tries)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED and tries[0] > 1:
                released_before[0] += 1  # re-sent after its replica died mid-call: the first try went through
            else:
                release_errors.append(f"{exc.code().name}: {exc.details()}"[:200])
        turns.append((group, job, grant.token, asked, granted, released))
        return took

    for ch in channels.values():
        await ch.channel_ready()
    await asyncio.sleep(max(0.0, start_at - time.time()))
    t0 = time.perf_counter()
    burst = [x for x in await asyncio.gather(*(turn(j, g) for j, g in tenants)) if x is not None]
    burst_s = time.perf_counter() - t0
    if os.environ.get("SCALE_MARKS"):  # tell the parent the steady phase begins (it times the kill by it)
        open(os.path.join(os.environ["SCALE_MARKS"], f"{os.getpid()}.steady"), "w").close()

    steady: list[float] = []
    probes: list[float] = []
    deadline = time.perf_counter() + seconds
    steady_from = time.time()

    async def loop(job: str, group: str, out: list[float]) -> None:
        while time.perf_counter() < deadline:
            took = await turn(job, group)
            if took is not None:
                out.append(took)

    t0 = time.perf_counter()
    await asyncio.gather(*(loop(j, g, steady) for j, g in tenants), loop(probe, probe, probes))
    steady_s = time.perf_counter() - t0
    for ch in channels.values():
        await ch.close()
    # the probe's first acquire starts together with every tenant's loop (1,000 requests at once) and creates
    # its group: reported apart from the rest (alone on an idle replica it takes 3-7 ms)
    return {"burst": burst, "burst_s": burst_s, "steady": steady, "steady_s": steady_s, "probe": probes[1:],
            "probe_first": probes[:1],
            "steady_from": steady_from, "turns": turns, "release_errors": release_errors,
            "redirects": redirects[0], "acquire_timeouts": acquire_timeouts[0],
            "released_before": released_before[0]}


def shard_leaders(url: str, prefix: str, shards: int) -> dict[int, str]:
    from rota_etcd.testing import leader_of
    from rota_etcd.testing import shard_leaders as read

    if shards == 1:
        return {0: rec["address"]} if (rec := leader_of(url, prefix)) else {}
    return read(url, prefix)


def double_grants(turns: list[list]) -> int:
    """Pairs of turns of one group whose grant..release intervals overlap, plus tokens granted twice."""
    by_group: dict[str, list] = {}
    for t in turns:
        by_group.setdefault(t[0], []).append(t)
    bad = 0
    for ts in by_group.values():
        ts.sort(key=lambda t: t[4])
        bad += len(ts) - len({t[2] for t in ts})
        bad += sum(1 for a, b in itertools.pairwise(ts) if b[4] < a[5] and b[1] != a[1])
    return bad


def replica_rss(server: subprocess.Popen) -> int | None:
    """Resident bytes of a replica (its process under py-spy when profiled); None once it is gone."""
    import psutil

    try:
        proc = psutil.Process(server.pid)
        if server.poll() is None and proc.children():  # py-spy record -- python -m rota ...
            proc = proc.children()[0]
        return proc.memory_info().rss
    except psutil.NoSuchProcess:
        return None


def memory_report(before: list[int | None], after: list[int | None], tenants: int) -> dict:
    """The replicas' RSS before the tenants came and at the end, and what the tenants added per tenant, over
    the replicas alive at the end (a killed replica's groups moved to those, so every tenant is in one of them)."""
    alive = [(b, a) for b, a in zip(before, after, strict=True) if b is not None and a is not None]
    added = sum(a - b for b, a in alive)
    return {"rss_before_bytes": before, "rss_after_bytes": after, "tenants": tenants, "added_bytes": added,
            "bytes_per_tenant": round(added / tenants) if alive else None}


def run_once(ns: argparse.Namespace, url: str, replicas: int, kill: bool) -> dict:
    prefix = f"/rota-scale-{os.getpid()}-{replicas}{'-kill' if kill else ''}"
    env = dict(os.environ, ROTA_ETCD_PREFIX=prefix, ROTA_ETCD_SHARDS=str(ns.shards),
               ROTA_ETCD_LEADER_TTL=str(ns.leader_ttl))
    endpoints = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
    servers = []
    for i, ep in enumerate(endpoints):
        cmd = [sys.executable, "-m", "rota", "orchestrator", "serve", "--etcd", url, "--listen", ep, "--insecure"]
        if ns.profile and i == 0:
            cmd = ["py-spy", "record", "--rate", "200", "--format", os.environ.get("SCALE_PYSPY_FORMAT", "flamegraph"),
                   "-o", ns.profile, "--", *cmd]
        log = open(os.path.join(ns.logs, f"replica-{replicas}{'-kill' if kill else ''}-{i}.log"), "ab") \
            if ns.logs else subprocess.DEVNULL
        servers.append(subprocess.Popen(cmd, stderr=log, env=env))
    try:
        deadline = time.monotonic() + 60
        while True:  # every shard led, and every replica leading its share
            leaders = shard_leaders(url, prefix, ns.shards)
            if len(leaders) == ns.shards and set(leaders.values()) == set(endpoints):
                break
            if time.monotonic() > deadline or any(s.poll() is not None for s in servers):
                sys.exit(f"{replicas} replicas did not share the {ns.shards} shards within 60 s: {leaders}")
            time.sleep(0.2)
        time.sleep(1.0)  # let the last leaders load
        rss_before = [replica_rss(s) for s in servers]
        load_before = os.getloadavg()
        tenants = [(f"tenant-{i}", f"group-{i % ns.groups}") for i in range(ns.tenants)]
        shares = [tenants[w::ns.workers] for w in range(ns.workers)]
        start_at = time.time() + 3.0
        env["SCALE_MARKS"] = marks = tempfile.mkdtemp(prefix="rota-scale-marks-")
        print(f"scale: {ns.tenants} tenants over {ns.groups} groups, {replicas} replicas, {ns.shards} shards, "
              f"{ns.workers} client processes{', killing a shard leader' if kill else ''}", file=sys.stderr)
        procs = [subprocess.Popen([sys.executable, __file__, "--_worker", ",".join(endpoints),
                                   ",".join(f"{j}@{g}" for j, g in share), str(start_at), str(ns.seconds),
                                   f"probe-{w}", str(ns.turn_ms)], stdout=subprocess.PIPE, text=True, env=env)
                 for w, share in enumerate(shares)]
        killed = None
        if kill:
            from rota_etcd._shards import shard_of

            while len(os.listdir(marks)) < len(procs):  # every worker past its burst
                if any(p.poll() is not None for p in procs):
                    break
                time.sleep(0.05)
            time.sleep(ns.seconds / 2)
            before = shard_leaders(url, prefix, ns.shards)
            victim = before[shard_of("probe-0", ns.shards)]
            killed = {"replica": victim, "at": time.time(),
                      "shards": sorted(s for s, ep in before.items() if ep == victim)}
            servers[endpoints.index(victim)].send_signal(signal.SIGKILL)
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=600 + ns.seconds)
            if p.returncode != 0:
                sys.exit(f"a client process failed with exit code {p.returncode}")
            results.append(json.loads(out))
        rss_after = [replica_rss(s) for s in servers]  # every tenant known to its group's leader by now
        load_after = os.getloadavg()
    finally:
        for s in servers:
            with contextlib.suppress(ProcessLookupError):
                s.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        for s in servers:
            try:
                s.wait(30)
            except subprocess.TimeoutExpired:
                s.kill()

    ms = [[x * 1000 for r in results for x in r[k]] for k in ("burst", "steady", "probe")]
    burst, steady, probe = ms
    burst_s = max(r["burst_s"] for r in results)
    steady_s = max(r["steady_s"] for r in results)
    turns = [t for r in results for t in r["turns"]]
    out = {
        "replicas": replicas, "shards": ns.shards,
        "burst": {"grants": len(burst), "seconds": round(burst_s, 3), "grants_per_s": round(len(burst) / burst_s, 1),
                  "acquire_p50_ms": percentile(burst, 50), "acquire_p99_ms": percentile(burst, 99)},
        "steady": {"grants": len(steady), "seconds": round(steady_s, 3),
                   "grants_per_s": round(len(steady) / steady_s, 1),
                   "acquire_p50_ms": percentile(steady, 50), "acquire_p99_ms": percentile(steady, 99)},
        "free_group_under_load": {"grants": len(probe), "acquire_p50_ms": percentile(probe, 50),
                                  "acquire_p99_ms": percentile(probe, 99), "acquire_max_ms": max(probe, default=0.0),
                                  "first_acquire_ms": [round(x * 1000, 1) for r in results for x in r["probe_first"]]},
        "double_grants": double_grants(turns),
        "release_errors": sum(len(r["release_errors"]) for r in results),
        "release_error_samples": [e for r in results for e in r["release_errors"]][:5],
        "releases_resent_after_done": sum(r["released_before"] for r in results),
        "redirects": sum(r["redirects"] for r in results),
        "acquire_timeouts_120s": sum(r["acquire_timeouts"] for r in results),
        "memory": memory_report(rss_before, rss_after, ns.tenants + len(results)),
        "load_average_1m": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
    }
    if killed is not None:
        from rota_etcd._shards import shard_of

        groups = {t[0] for t in turns if shard_of(t[0], ns.shards) in killed["shards"]}
        regrant = []
        for g in sorted(groups):
            after = [t[4] for t in turns if t[0] == g and t[4] > killed["at"]]
            if after:
                regrant.append(min(after) - killed["at"])
        out["kill"] = {"replica_shards": len(killed["shards"]), "groups": len(groups),
                       "groups_never_granting_again": len(groups) - len(regrant),
                       "leader_ttl_s": ns.leader_ttl, "target_s": 2 * ns.leader_ttl,
                       "regrant_p50_s": round(percentile(regrant, 50), 3),
                       "regrant_max_s": round(max(regrant), 3) if regrant else None}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the steady phase (default 20)")
    ap.add_argument("--replicas", default="1,2,3", help="replica counts to run (default 1,2,3)")
    ap.add_argument("--shards", type=int, default=12, help="ROTA_ETCD_SHARDS (default 12)")
    ap.add_argument("--leader-ttl", type=float, default=5.0, help="ROTA_ETCD_LEADER_TTL s (default 5, its default)")
    ap.add_argument("--kill", action="store_true", help="also run the largest count killing a shard leader")
    ap.add_argument("--etcd", default="", help="etcd URL (default: start a one-member etcd on loopback)")
    ap.add_argument("--out", default="bench/results/scale-etcd-cpu.json")
    ap.add_argument("--logs", default="", help="write each replica's log into this folder")
    ap.add_argument("--profile", default="", help="record the first replica with py-spy into this flame graph (SVG)")
    ap.add_argument("--turn-ms", type=float, default=0.0,
                    help="how long each tenant holds its turn before releasing (default 0: back to back)")
    ap.add_argument("--_worker", nargs=6, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns._worker:
        endpoints, spec, start, seconds, probe, hold_ms = ns._worker
        tenants = [tuple(x.split("@")) for x in spec.split(",")]
        print(json.dumps(asyncio.run(worker(endpoints.split(","), tenants, float(start), float(seconds), probe,
                                            float(hold_ms) / 1000))))
        return
    counts = [int(x) for x in ns.replicas.split(",") if x.strip()]
    if ns.tenants < ns.groups or ns.groups < 1 or ns.workers < 1 or not counts or min(counts) < 1 or ns.shards < 1:
        ap.error("need --groups >= 1, --tenants >= --groups, --workers >= 1, --shards >= 1, --replicas like 1,2,3")

    load_at_start = os.getloadavg()  # others' work on these cores too (1, 5, 15 min)
    etcd = None
    url = ns.etcd
    if not url:
        from rota_etcd.testing import EtcdCluster

        etcd = EtcdCluster(tempfile.mkdtemp(prefix="rota-scale-etcd-")).start()
        url = etcd.url
    try:
        runs = [run_once(ns, url, n, False) for n in counts]
        if ns.kill:
            runs.append(run_once(ns, url, max(counts), True))
    finally:
        if etcd is not None:
            etcd.stop()
    result = {
        "benchmark": "scale", "store": "etcd (1 member, loopback)", "tenants": ns.tenants, "groups": ns.groups,
        "client_processes": ns.workers, "cores": os.cpu_count(), "machine": f"{platform.node()} {os.cpu_count()} cpu",
        "python": platform.python_version(), "steady_seconds": ns.seconds, "turn_ms": ns.turn_ms,
        "load_average_at_start": [round(x, 2) for x in load_at_start], "runs": runs,
        "note": "everything (etcd, every replica, the client processes) shares these cores. burst/steady acquire "
                "latency includes waiting behind the group's other tenants (10 per group); free_group_under_load "
                "is a tenant alone in its group (one per client process) during the steady phase; kill: SIGKILL of "
                "the replica leading the first probe's shard halfway through steady, regrant = kill -> first grant "
                "of each of its groups; memory: the replicas' RSS (VmRSS) once leaders are loaded and after the "
                "last client ended, bytes_per_tenant = what they grew by / tenants (probes included); "
                "load_average: the 1-minute load of these cores (other work on them shows here)",
    }
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)
    for r in runs:
        b, s, p = r["burst"], r["steady"], r["free_group_under_load"]
        kill = r.get("kill")
        print(f"scale: {r['replicas']} replicas: burst {b['grants_per_s']:.0f} grants/s; steady {s['grants_per_s']:.0f}"
              f" grants/s, acquire p50 {s['acquire_p50_ms']:.0f} ms p99 {s['acquire_p99_ms']:.0f} ms; free group "
              f"p50 {p['acquire_p50_ms']:.1f} ms p99 {p['acquire_p99_ms']:.1f} ms; double grants {r['double_grants']}"
              f"; {r['memory']['bytes_per_tenant']} bytes/tenant; load {r['load_average_1m']['after']}"
              + (f"; killed leader of {kill['replica_shards']} shards: groups grant again after p50 "
                 f"{kill['regrant_p50_s']} s, max {kill['regrant_max_s']} s (target < {kill['target_s']:g} s)"
                 if kill else ""), file=sys.stderr)
    print(f"scale: -> {ns.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
