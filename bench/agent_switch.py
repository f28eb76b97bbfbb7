"""Switch cost through rota-agent: whole-process ``cuda`` backend and region-level ``app_channel``.

Part 1, whole-process (``--parts cuda``; the code is in bench/agent_whole.py, whose docstring says what is
measured): N tenant processes of one job register with the agent as a real job does (its Unix socket,
pids proven by its door), the agent parks them through the CUDA driver's checkpoint API, another process
uses the freed memory, the agent restores them and each checks its bytes; park/restore seconds and GB/s
against a pinned-copy floor measured in the same run. ``--procs`` (tenant processes of S/N bytes each,
parked at once) and ``--parallel`` (pids the agent drives at once per driver step; 1 = one after
another) are the knobs rota controls.

Part 2, region-level end to end: two tenant processes, each ``rota.connect`` +
``rota_fsdp.track`` (S bytes of weights) + ``rota_agent.register``, share a group of an
orchestrator configured with the agent. Holder releases → orchestrator asks the agent
to park it and restore the waiter (overlapped) → waiter's grant. Measured from the
holder's release call to the waiter's acquire returning (synchronised), on
CLOCK_MONOTONIC, which both processes share. Floor: in this process, a bare copy of
min(S, 8 GB) D2H and H2D at once on two streams between device and pre-pinned
buffers, scaled to S. ratio = end-to-end / floor. After each switch the agent's Status
gives the residue the parked job's adapters reported, by category (tracked tags,
``untracked:NAME``, ``process:allocated``/``reserved``), and NVML bytes of its pids
(reported, not counted: they include the CUDA context).

Any failed park, restore or check (registration, release, bytes) is counted in the JSON (``failures``,
``errors``) and makes the bench exit 1 naming it.

    python bench/agent_switch.py --parts cuda --sizes 4GB,40GB --procs 1,4 --parallel 1,8  # H200, ~2.5 min
    python bench/agent_switch.py --parts region --sizes 4GB,40GB --out $OUT   # part 2, on a GPU node
    python bench/agent_switch.py --device cpu --sizes 64MB       # region part only, CPU
    python bench/agent_switch.py --device cpu --parts cuda --driver fake --sizes 64MB --procs 1,2   # dry run
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import time

from agent_whole import Proc, int_list, other_process, parse_size, residue_of, whole_process, whole_tenant

log = logging.getLogger("agent_switch")


def region_tenant(args: argparse.Namespace) -> None:
    """rota.connect + rota_fsdp.track + rota_agent.register; acquire/release on command."""
    import torch

    import rota
    import rota_agent
    import rota_fsdp

    dev = torch.device(args.device)
    n = args.tensors
    item = 2
    elems = args.bytes // item // n // 64 * 64
    gen = torch.Generator(device=dev).manual_seed(hash(args.job) % 1000)
    ts = [torch.empty(elems, dtype=torch.bfloat16, device=dev).uniform_(-1, 1, generator=gen) for _ in range(n)]
    real = sum(t.numel() * item for t in ts)
    model = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in ts])
    gpu = rota.connect(group=args.group, tenant=args.job, endpoint=args.orch)
    tracked = rota_fsdp.track(gpu, model, tags=("weights",), device=dev, pool_bytes=0)
    setup = tracked.prepare(real + 512 * n)
    client = rota_agent.register(gpu, args.agent).wait_registered()

    def check() -> list[int]:
        return [int(p.view(torch.int16).sum(dtype=torch.int64)) for p in model]

    want = check()
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(json.dumps({"ready": True, "bytes": real, "pool_setup_s": setup}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "acquire":
            g = gpu.acquire()
            sync()
            t = time.monotonic()
            print(json.dumps({"t": t, "restored": g.context_restored, "identical": check() == want,
                              "agent_cmds": [k for k, ok, _ in client.commands if ok]}), flush=True)
        elif cmd == "release":
            t = time.monotonic()
            gpu.release()
            print(json.dumps({"t": t}), flush=True)
        elif cmd == "exit":
            break
    client.close()
    gpu.close()


# ------------------------------------------------------------------ part 2: region level (app_channel)


def floor(device: str, nbytes: int, repeats: int = 3) -> dict:
    import torch

    if device != "cuda":
        return {}
    n = min(nbytes, 8 * 10**9) // 2 * 2
    buf = {"d1": torch.empty(n, dtype=torch.uint8, device="cuda"),
           "d2": torch.empty(n, dtype=torch.uint8, device="cuda"),
           "h1": torch.empty(n, dtype=torch.uint8, pin_memory=True),
           "h2": torch.empty(n, dtype=torch.uint8, pin_memory=True)}
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        out = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    def d2h() -> None:
        with torch.cuda.stream(s1):
            buf["h1"].copy_(buf["d1"], non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s2):
            buf["d2"].copy_(buf["h2"], non_blocking=True)

    def both() -> None:
        d2h()
        h2d()

    res = {"floor_bytes": n, "d2h_GBps": n / 1e9 / timed(d2h), "h2d_GBps": n / 1e9 / timed(h2d),
           "overlap_s": timed(both)}
    res["overlap_GBps_each_way"] = n / 1e9 / res["overlap_s"]
    buf.clear()
    torch.cuda.empty_cache()
    return res


def parked_residue(stub, job: str, device: str) -> dict:
    """Residue the agent holds for ``job`` after its last park (adapters by category, NVML per pid)."""
    from rota.wire import snapshot_agent_pb2 as sa
    from rota_agent_client.extension import ext

    st = stub.Status(sa.StatusRequest(), timeout=10)
    out = {"job": job, "state": ""}
    for j in st.job_statuses:
        if j.job_id == job:
            out.update(residue_of(j, ext.JobStatusExt), state=sa.JobState.Name(j.state))
    if device == "cuda":
        import torch

        out["device_free_bytes"] = torch.cuda.mem_get_info()[0]
    return out


def region(stub, orch: str, agent: str, device: str, nbytes: int, switches: int, tensors: int) -> dict:
    fl = floor(device, nbytes)
    common = ["--role", "region-tenant", "--orch", orch, "--agent", agent, "--group", f"rg-{nbytes}",
              "--bytes", str(nbytes), "--device", device, "--tensors", str(tensors)]
    a = Proc([*common, "--job", f"ra-{nbytes}"], f"region tenant ra-{nbytes}")
    b = Proc([*common, "--job", f"rb-{nbytes}"], f"region tenant rb-{nbytes}")
    try:
        ia, ib = a.read(), b.read()
        real = ia["bytes"]
        a.send("acquire")
        a.read()
        holder, waiter = a, b
        waiter.send("acquire")
        e2e, ok, residues = [], True, []
        jobs = {id(a): f"ra-{nbytes}", id(b): f"rb-{nbytes}"}
        for i in range(switches + 1):
            holder.send("release")
            t_rel = holder.read()["t"]
            got = waiter.read()
            residues.append(parked_residue(stub, jobs[id(holder)], device))  # the holder was just parked
            if i > 0:  # the first switch only parks (the waiter was never parked): warm-up
                e2e.append(got["t"] - t_rel)
                ok &= got["restored"] and got["identical"]
            holder.send("acquire")
            holder, waiter = waiter, holder
            log.warning("region %.1f GB switch %d: %.3f s restored %s identical %s cmds %s", real / 1e9, i,
                        got["t"] - t_rel, got["restored"], got["identical"], got["agent_cmds"][-4:])
        holder.send("release")
        holder.read()
        waiter.read()
        waiter.send("release")
        waiter.read()
    finally:
        a.close()
        b.close()
    med = statistics.median(e2e)
    out = {"size_bytes": real, "switches": e2e, "end_to_end_s": med, "bit_identical_and_restored": ok,
           "pool_setup_s": [ia["pool_setup_s"], ib["pool_setup_s"]], "residue_after_park": residues,
           "residue_counted_bytes_max": max((r.get("counted_bytes", 0) for r in residues), default=0), **fl}
    if fl:
        out["floor_switch_s"] = fl["overlap_s"] * real / fl["floor_bytes"]
        out["ratio_vs_floor"] = med / out["floor_switch_s"]
    return out



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--role", default="main", choices=["main", "whole-tenant", "other", "region-tenant"])
    ap.add_argument("--sizes", default="4GB,40GB")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=1, help="part 1: parks and restores per case")
    ap.add_argument("--procs", default="1", help="part 1: tenant processes of the job, each S/N bytes (list: 1,4)")
    ap.add_argument("--parallel", default="8",
                    help="part 1: pids the agent drives at once per driver step (list: 1,8; 1 = one after another)")
    ap.add_argument("--floor-max", default="4GB", help="part 1: bytes the copy floor is measured on, at most")
    ap.add_argument("--step-timeout", type=float, default=120.0, help="part 1: the agent's --step-timeout (s)")
    ap.add_argument("--driver", default="real", choices=["real", "fake"],
                    help="part 1: libcuda's checkpoint API, or a fake of it for a dry run without a GPU")
    ap.add_argument("--fake-fail", default="", choices=["", "lock", "checkpoint", "restore", "unlock"],
                    help="with --driver fake: this step fails for one pid (to see a failure counted and named)")
    ap.add_argument("--switches", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--parts", default="cuda,region")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="", help="JSON file name (default agent-DEVICE.json; -region for part 2 only)")
    for a in ("--orch", "--agent", "--job", "--group"):
        ap.add_argument(a, default="")
    ap.add_argument("--bytes", type=int, default=0)
    ap.add_argument("--residue-max-bytes", type=int, default=None,
                    help="the agent's limit (default: ROTA_RESIDUE_MAX_BYTES, else 256 MiB; 0 = record only)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="[agent_switch %(asctime)s] %(message)s")
    if args.role == "whole-tenant":
        return whole_tenant(args)
    if args.role == "other":
        return other_process(args)
    if args.role == "region-tenant":
        return region_tenant(args)

    parts = set(args.parts.split(","))
    if parts - {"cuda", "region"} or not parts:
        raise SystemExit(f"--parts {args.parts!r}: give cuda, region or both (cuda,region)")
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    args.procs, args.parallel = int_list(args.procs, "--procs"), int_list(args.parallel, "--parallel")
    args.floor_max = parse_size(args.floor_max)
    if args.repeats < 1 or args.step_timeout <= 0:
        raise SystemExit("--repeats must be >= 1 and --step-timeout > 0")
    if args.driver == "fake" and args.device != "cpu":
        raise SystemExit("--driver fake is a dry run for a machine without a GPU: use it with --device cpu")
    if args.fake_fail and args.driver != "fake":
        raise SystemExit("--fake-fail needs --driver fake")
    result: dict = {"host": platform.node(), "device": args.device, "gpu": "", "argv": sys.argv[1:],
                    "whole_process_cuda": [], "region_app_channel": [], "errors": [], "failures": []}
    os.makedirs(args.out, exist_ok=True)
    name = args.name or f"agent-{args.device}{'-region' if parts == {'region'} else ''}.json"
    path = os.path.join(args.out, name)

    def save() -> None:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    if "cuda" in parts:
        if args.device == "cuda" or args.driver == "fake":
            whole_process(args, sizes, result, save)
        else:
            log.warning("part 1 (whole process) skipped: no CUDA device here; --parts cuda --driver fake dry-runs it")
            result["whole_process_skipped"] = "no CUDA device (--device cpu); --driver fake dry-runs it"
    if "region" in parts:
        region_part(args, sizes, result, save)
    save()
    print(json.dumps(result, indent=2))
    bad = [f"{f['part']} {f['size_bytes'] / 1e9:g} GB x{f['procs']} parallel {f['parallel']}: {f['step']}: "
           f"{f['error']}" for f in result["failures"]] + result["errors"]
    if bad:
        print(f"agent_switch: {len(bad)} failed (see {path}):", *bad, sep="\n  ", file=sys.stderr)
        sys.exit(1)


def region_part(args: argparse.Namespace, sizes: list[int], result: dict, save) -> None:
    import grpc
    import torch

    from rota.orchestrator import OrchestratorConfig
    from rota.testing import running_orchestrator
    from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
    from rota_agent import Agent, running_agent

    result["torch"] = torch.__version__
    if args.device == "cuda" and not result["gpu"]:
        result["gpu"] = torch.cuda.get_device_name()
    agent = Agent(residue_max_bytes=args.residue_max_bytes)
    result["residue_max_bytes"] = agent.residue_max_bytes
    with running_agent(agent) as (agent_ep, _), grpc.insecure_channel(agent_ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        cfg = OrchestratorConfig(ttl_s=30.0, park_timeout_s=280.0, agents=(agent_ep,))
        with running_orchestrator(cfg) as (orch, _):
            for size in sizes:
                try:
                    got = region(stub, orch, agent_ep, args.device, size, args.switches, args.tensors)
                    result["region_app_channel"].append(got)
                    if not got["bit_identical_and_restored"]:
                        result["errors"].append(f"region {size}: a restored job's bytes differ or it was not "
                                                "restored")
                except Exception as exc:
                    log.exception("region at %d bytes failed", size)
                    result["errors"].append(f"region {size}: {type(exc).__name__}: {exc}")
                save()


if __name__ == "__main__":
    main()
