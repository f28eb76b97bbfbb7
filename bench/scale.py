"""Scale: many tenants over many groups against one etcd-backed orchestrator.

1,000 tenants (default) share 100 groups, 10 per group. They are driven by a few
worker processes as asyncio tasks speaking rota.v1 Acquire/Release over gRPC (no
sessions, like v1alpha1 clients), against `rota orchestrator serve --etcd` and one
etcd member on loopback. Two phases:

* burst: every tenant asks at the same moment, once; acquire latency (ask -> grant,
  queueing behind the group's other tenants included) and grants/s until all are done;
* steady: for --seconds, every tenant loops acquire -> release; grants/s and acquire
  latency. Meanwhile a probe tenant alone in its own group loops too: its acquire
  latency is what a tenant whose GPU is free waits under that load.

Writes JSON (default bench/results/scale-etcd-cpu.json).

    python bench/scale.py [--tenants 1000] [--groups 100] [--workers 4] [--seconds 20] [--etcd URL]
"""

from __future__ import annotations

import argparse
import asyncio
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


async def worker(endpoint: str, tenants: list[tuple[str, str]], start_at: float, seconds: float,
                 with_probe: bool) -> dict:
    import grpc

    from rota._generated import rota_v1_pb2 as pb
    from rota._generated import rota_v1_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(endpoint) as ch:
        stub = pb_grpc.RotaServiceStub(ch)
        await ch.channel_ready()

        async def turn(job: str, group: str) -> float:
            t0 = time.perf_counter()
            grant = await stub.Acquire(pb.TurnRequest(job_id=job, group_id=group), wait_for_ready=True)
            took = time.perf_counter() - t0
            await stub.Release(pb.ReleaseRequest(job_id=job, group_id=group, token=grant.token))
            return took

        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        burst = await asyncio.gather(*(turn(j, g) for j, g in tenants))
        burst_s = time.perf_counter() - t0

        steady: list[float] = []
        probe: list[float] = []
        deadline = time.perf_counter() + seconds

        async def loop(job: str, group: str, out: list[float]) -> None:
            while time.perf_counter() < deadline:
                out.append(await turn(job, group))

        t0 = time.perf_counter()
        probes = [loop(f"probe-{os.getpid()}", f"probe-{os.getpid()}", probe)] if with_probe else []
        await asyncio.gather(*(loop(j, g, steady) for j, g in tenants), *probes)
        steady_s = time.perf_counter() - t0
    return {"burst": burst, "burst_s": burst_s, "steady": steady, "steady_s": steady_s, "probe": probe}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tenants", type=int, default=1000)
    ap.add_argument("--groups", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of the steady phase (default 20)")
    ap.add_argument("--etcd", default="", help="etcd URL (default: start a one-member etcd on loopback)")
    ap.add_argument("--out", default="bench/results/scale-etcd-cpu.json")
    ap.add_argument("--profile", default="", help="record the orchestrator with py-spy into this flame graph (SVG)")
    ap.add_argument("--_worker", nargs=5, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns._worker:
        endpoint, spec, start, seconds, probe = ns._worker
        tenants = [tuple(x.split("@")) for x in spec.split(",")]
        print(json.dumps(asyncio.run(worker(endpoint, tenants, float(start), float(seconds), probe == "1"))))
        return
    if ns.tenants < ns.groups or ns.groups < 1 or ns.workers < 1:
        ap.error("need --groups >= 1, --tenants >= --groups and --workers >= 1")

    etcd = None
    url = ns.etcd
    if not url:
        from rota_etcd.testing import EtcdCluster

        etcd = EtcdCluster(tempfile.mkdtemp(prefix="rota-scale-etcd-")).start()
        url = etcd.url
    endpoint = f"127.0.0.1:{free_port()}"
    env = dict(os.environ, ROTA_ETCD_PREFIX=f"/rota-scale-{os.getpid()}")
    cmd = [sys.executable, "-m", "rota", "orchestrator", "serve", "--etcd", url, "--listen", endpoint, "--insecure"]
    if ns.profile:
        cmd = ["py-spy", "record", "--rate", "200", "--format", os.environ.get("SCALE_PYSPY_FORMAT", "flamegraph"), "-o", ns.profile, "--", *cmd]
    server = subprocess.Popen(cmd, stderr=subprocess.DEVNULL, env=env)
    try:
        from rota._local import is_serving

        deadline = time.monotonic() + 30
        while not is_serving(endpoint, 0.5):
            if time.monotonic() > deadline or server.poll() is not None:
                sys.exit(f"orchestrator did not start on {endpoint}")
        time.sleep(1.0)  # election
        tenants = [(f"tenant-{i}", f"group-{i % ns.groups}") for i in range(ns.tenants)]
        shares = [tenants[w::ns.workers] for w in range(ns.workers)]
        start_at = time.time() + 3.0
        print(f"scale: {ns.tenants} tenants over {ns.groups} groups, {ns.workers} client processes, etcd {url}",
              file=sys.stderr)
        procs = [subprocess.Popen([sys.executable, __file__, "--_worker", endpoint,
                                   ",".join(f"{j}@{g}" for j, g in share), str(start_at), str(ns.seconds),
                                   "1" if w == 0 else "0"],
                                  stdout=subprocess.PIPE, text=True) for w, share in enumerate(shares)]
        results = []
        for p in procs:
            out, _ = p.communicate(timeout=600 + ns.seconds)
            if p.returncode != 0:
                sys.exit(f"a client process failed with exit code {p.returncode}")
            results.append(json.loads(out))
    finally:
        server.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
        server.wait(30)
        if etcd is not None:
            etcd.stop()

    burst = [x * 1000 for r in results for x in r["burst"]]
    steady = [x * 1000 for r in results for x in r["steady"]]
    probe = [x * 1000 for r in results for x in r["probe"]]
    burst_s = max(r["burst_s"] for r in results)
    steady_s = max(r["steady_s"] for r in results)
    result = {
        "benchmark": "scale", "store": "etcd (1 member, loopback)", "tenants": ns.tenants, "groups": ns.groups,
        "client_processes": ns.workers, "machine": f"{platform.node()} {os.cpu_count()} cpu",
        "python": platform.python_version(),
        "burst": {"grants": len(burst), "seconds": round(burst_s, 3), "grants_per_s": round(len(burst) / burst_s, 1),
                  "acquire_p50_ms": percentile(burst, 50), "acquire_p99_ms": percentile(burst, 99)},
        "steady": {"grants": len(steady), "seconds": round(steady_s, 3),
                   "grants_per_s": round(len(steady) / steady_s, 1),
                   "acquire_p50_ms": percentile(steady, 50), "acquire_p99_ms": percentile(steady, 99)},
        "free_group_under_load": {"grants": len(probe), "acquire_p50_ms": percentile(probe, 50),
                                  "acquire_p99_ms": percentile(probe, 99)},
        "note": "burst/steady acquire latency includes waiting behind the group's other tenants (10 per group); "
                "free_group_under_load is a tenant alone in its group during the steady phase",
    }
    os.makedirs(os.path.dirname(ns.out) or ".", exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)
    b, s = result["burst"], result["steady"]
    print(f"scale: burst {b['grants']} grants in {b['seconds']:.2f} s ({b['grants_per_s']:.0f}/s), acquire p50 "
          f"{b['acquire_p50_ms']:.1f} ms p99 {b['acquire_p99_ms']:.1f} ms; steady {s['grants_per_s']:.0f} grants/s, "
          f"acquire p50 {s['acquire_p50_ms']:.1f} ms p99 {s['acquire_p99_ms']:.1f} ms; free group under load: acquire "
          f"p50 {percentile(probe, 50):.1f} ms p99 {percentile(probe, 99):.1f} ms -> {ns.out}")


if __name__ == "__main__":
    main()
