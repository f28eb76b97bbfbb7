"""Switch cost through rota-agent: whole-process ``cuda`` backend and region-level ``app_channel``.

Part 1, whole-process (``--sizes``): a tenant process fills S bytes of device memory
with random data; the agent (in this process, real gRPC) parks it through the CUDA
driver's checkpoint API (Snapshot with explicit pids, polled with GetOperation), then
this process — another process — allocates and fills 95% of the memory that was freed;
then the agent restores the tenant, which checks its bytes (per-GiB int64 and int32
sums) against the values it had before. Reports park/restore seconds and GB/s, and
the residue after park: the agent's verified-release report (NVML bytes still held by
the parked pid, ``nvml:pid:PID``, counted against ``--residue-max-bytes``) plus device
free memory before and after the park, seen from this process.

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

    python bench/agent_switch.py --sizes 4GB,40GB --out $OUT     # on a GPU node
    python bench/agent_switch.py --device cpu --sizes 64MB       # region part only, CPU
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import queue
import statistics
import subprocess
import sys
import threading
import time

log = logging.getLogger("agent_switch")
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "GIB": 2**30, "MIB": 2**20, "B": 1}
CHUNK = 2**30


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


# ------------------------------------------------------------------ tenant processes


def _sums(tensors: list) -> list[list[int]]:
    import torch

    return [[int(t.view(torch.int64).sum()), int(t.view(torch.int32).sum(dtype=torch.int64))] for t in tensors]


def cuda_tenant(nbytes: int) -> None:
    """Holds ``nbytes`` of random device data; verifies it on 'verify'."""
    import torch

    chunks = []
    left = nbytes
    while left > 0:
        n = min(CHUNK, left) // 8 * 8
        chunks.append(torch.empty(n, dtype=torch.uint8, device="cuda").random_())
        left -= CHUNK
    torch.cuda.synchronize()
    want = _sums(chunks)
    print(json.dumps({"pid": os.getpid(), "bytes": sum(c.numel() for c in chunks)}), flush=True)
    for line in sys.stdin:
        if line.strip() == "verify":
            got = _sums(chunks)
            print(json.dumps({"identical": got == want}), flush=True)
        elif line.strip() == "exit":
            return


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


class Proc:
    def __init__(self, argv: list[str]) -> None:
        self.p = subprocess.Popen([sys.executable, __file__, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                self.q.put(json.loads(line))
        self.q.put(None)

    def read(self, timeout: float = 240) -> dict:
        msg = self.q.get(timeout=timeout)
        if msg is None:
            raise RuntimeError(f"tenant exited with {self.p.wait(10)}")
        return msg

    def send(self, cmd: str) -> None:
        self.p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]

    def close(self) -> None:
        try:
            self.send("exit")
            self.p.wait(30)
        except Exception:
            self.p.kill()
            self.p.wait(10)


# ------------------------------------------------------------------ measurements


def residue_of(msg, kind) -> dict:
    """The agent's rota-owned residue report inside a GetOperationResponse or JobStatus."""
    from rota_agent_client.extension import read

    r = read(msg, kind).residue
    return {"by_key": dict(r.bytes), "counted_bytes": r.counted_bytes, "limit_bytes": r.limit_bytes}


def wait_op(stub, op_id: str, timeout: float = 280):
    from rota.wire import snapshot_agent_pb2 as sa

    end = time.monotonic() + timeout
    pause = 0.002
    while time.monotonic() < end:
        got = stub.GetOperation(sa.GetOperationRequest(operation_id=op_id), timeout=10)
        if got.status != sa.OPERATION_STATUS_PENDING:
            return got
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    raise TimeoutError(f"operation {op_id} pending after {timeout} s")


def whole_process(stub, nbytes: int, repeats: int) -> dict:
    import torch

    from rota.wire import snapshot_agent_pb2 as sa
    from rota_agent_client.extension import ext

    t = Proc(["--role", "cuda-tenant", "--bytes", str(nbytes)])
    info = t.read()
    pid, real = info["pid"], info["bytes"]
    cfg = sa.BackendConfig(cuda=sa.CudaBackendConfig(explicit_target=sa.ProcessTarget(pids=[pid])))
    rows = []
    try:
        for i in range(repeats):
            torch.cuda.synchronize()
            free0, _ = torch.cuda.mem_get_info()
            t0 = time.perf_counter()
            op = stub.Snapshot(sa.SnapshotRequest(job_id=f"whole-{nbytes}", group="bench", backend_config=cfg),
                               timeout=30).operation_id
            got = wait_op(stub, op)
            park_s = time.perf_counter() - t0
            free1, _ = torch.cuda.mem_get_info()
            residue = residue_of(got, ext.GetOperationResponseExt)
            residue.update(nvml_pid_bytes=residue["by_key"].get(f"nvml:pid:{pid}"), device_free_before=free0,
                           device_free_after=free1)
            if got.status != sa.OPERATION_STATUS_COMPLETE:
                rows.append({"park_s": park_s, "residue_after_park": residue, "error": got.error})
                raise RuntimeError(f"snapshot failed: {got.error}; residue {residue}")
            freed = free1 - free0
            probe = int(freed * 0.95) // 8 * 8
            alloc_ok = False
            if probe > 0:
                x = torch.empty(probe, dtype=torch.uint8, device="cuda")
                x.fill_(7)
                torch.cuda.synchronize()
                alloc_ok = bool(x[-1].item() == 7)
                del x
                torch.cuda.empty_cache()
            t1 = time.perf_counter()
            op = stub.Restore(sa.RestoreRequest(job_id=f"whole-{nbytes}", group="bench"), timeout=30).operation_id
            got = wait_op(stub, op)
            restore_s = time.perf_counter() - t1
            if got.status != sa.OPERATION_STATUS_COMPLETE:
                raise RuntimeError(f"restore failed: {got.error}")
            t.send("verify")
            identical = t.read()["identical"]
            rows.append({"park_s": park_s, "restore_s": restore_s, "freed_bytes": freed, "probe_alloc_bytes": probe,
                         "other_process_allocated": alloc_ok, "bit_identical": identical,
                         "residue_after_park": residue})
            log.warning("cuda %s GB #%d: park %.2f s restore %.2f s freed %.1f GB alloc %s identical %s",
                        real / 1e9, i, park_s, restore_s, freed / 1e9, alloc_ok, identical)
    finally:
        t.close()
    med = statistics.median
    return {"size_bytes": real, "runs": rows, "park_s": med(r["park_s"] for r in rows),
            "restore_s": med(r["restore_s"] for r in rows),
            "park_GBps": real / 1e9 / med(r["park_s"] for r in rows),
            "restore_GBps": real / 1e9 / med(r["restore_s"] for r in rows),
            "freed_fraction": min(r["freed_bytes"] for r in rows) / real,
            "other_process_allocated": all(r["other_process_allocated"] for r in rows),
            "bit_identical": all(r["bit_identical"] for r in rows),
            "residue_nvml_bytes_max": max((r["residue_after_park"]["nvml_pid_bytes"] or 0) for r in rows)}


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
    a = Proc([*common, "--job", f"ra-{nbytes}"])
    b = Proc([*common, "--job", f"rb-{nbytes}"])
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
    ap.add_argument("--role", default="main", choices=["main", "cuda-tenant", "region-tenant"])
    ap.add_argument("--sizes", default="4GB,40GB")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--switches", type=int, default=3)
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--parts", default="cuda,region")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    for a in ("--orch", "--agent", "--job", "--group"):
        ap.add_argument(a, default="")
    ap.add_argument("--bytes", type=int, default=0)
    ap.add_argument("--residue-max-bytes", type=int, default=None,
                    help="the agent's limit (default: ROTA_RESIDUE_MAX_BYTES, else 256 MiB; 0 = record only)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING, format="[agent_switch %(asctime)s] %(message)s")
    if args.role == "cuda-tenant":
        return cuda_tenant(args.bytes)
    if args.role == "region-tenant":
        return region_tenant(args)

    import grpc
    import torch

    from rota.orchestrator import OrchestratorConfig
    from rota.testing import running_orchestrator
    from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
    from rota_agent import Agent, running_agent

    parts = set(args.parts.split(","))
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    result: dict = {"host": platform.node(), "torch": torch.__version__, "device": args.device,
                    "gpu": torch.cuda.get_device_name() if args.device == "cuda" else "",
                    "whole_process_cuda": [], "region_app_channel": [], "errors": []}
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"agent-{args.device}.json")

    def save() -> None:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)

    agent = Agent(residue_max_bytes=args.residue_max_bytes)
    result["residue_max_bytes"] = agent.residue_max_bytes
    with running_agent(agent) as (agent_ep, _), grpc.insecure_channel(agent_ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        cfg = OrchestratorConfig(ttl_s=30.0, park_timeout_s=280.0, agents=(agent_ep,))
        with running_orchestrator(cfg) as (orch, _):
            for size in sizes:
                for part in ("cuda", "region"):
                    if part not in parts or (part == "cuda" and args.device != "cuda"):
                        continue
                    try:
                        if part == "cuda":
                            result["whole_process_cuda"].append(whole_process(stub, size, args.repeats))
                        else:
                            result["region_app_channel"].append(
                                region(stub, orch, agent_ep, args.device, size, args.switches, args.tensors))
                    except Exception as exc:
                        log.exception("%s at %d bytes failed", part, size)
                        result["errors"].append(f"{part} {size}: {type(exc).__name__}: {exc}")
                    save()
    save()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
