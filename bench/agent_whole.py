"""Part 1 of bench/agent_switch.py: the whole-process ``cuda`` backend, parked through the CUDA driver.

N tenant processes (``--procs``) of one job each fill S/N bytes of device memory with random data and
register with the agent the way a real job does: a ``rota_agent_client.WorkloadClient`` with
``backend="cuda"`` over the agent's Unix socket, whose pid door proves each pid (SO_PEERCRED). The agent
(served in the bench's process with its socket directory, real gRPC) parks the job as the orchestrator
does (Snapshot with no config: the job's proven pids) through the driver's checkpoint API, each step for up
to ``--parallel`` pids at once (1 = one after another). Then ANOTHER process allocates and fills 95% of
the device memory that was freed and frees it; the agent restores the job and every tenant checks its
bytes (per-GiB int64 and int32 sums).

Per case: park and restore seconds and GB/s; each driver call's seconds per pid (lock, checkpoint, restore,
unlock) and how many ran at once; NVML of every parked pid (the agent's verified-release report, and read
here before and after); device free memory before and after. The floor, measured in the same run by that
other process on min(S, ``--floor-max``) bytes: D2H and H2D into pre-pinned memory; the pageable rates
(into fresh and into touched memory) and the host's single-thread first-touch rate, which say what bounds
the driver's own copy. A failed registration, park, restore, release check or byte check is counted in
the JSON (``failures``) and makes the bench exit 1 naming it. Without a GPU, ``--driver fake`` dry-runs
this part with a fake of the driver's state machine (it moves nothing); the registration, the agent and
the tenants are real.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

log = logging.getLogger("agent_switch")
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "agent_switch.py")  # its --role runs each process
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "GIB": 2**30, "MIB": 2**20, "B": 1}
CHUNK = 2**30
MIB = 2**20
SLACK = 256 * MIB  # what a parked pid may still hold on the device beside its CUDA context (NVML)
GROUP = "bench"


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def int_list(text: str, what: str) -> list[int]:
    try:
        got = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        got = []
    if not got or min(got) < 1:
        raise SystemExit(f"{what} {text!r} must be a comma-separated list of whole numbers >= 1, e.g. 1,4")
    return got


# ------------------------------------------------------------------ tenant processes


def _sums(tensors: list) -> list[list[int]]:
    import torch

    return [[int(t.view(torch.int64).sum()), int(t.view(torch.int32).sum(dtype=torch.int64))] for t in tensors]


def whole_tenant(args: argparse.Namespace) -> None:
    """Holds ``--bytes`` of random data on ``--device`` and registers with the agent as a real job does
    (backend cuda, over its Unix socket, pid proven by its door); checks its bytes on 'verify'."""
    import torch

    from rota import nvml
    from rota_agent_client import WorkloadClient

    dev = torch.device(args.device)
    context = None
    if dev.type == "cuda":
        torch.zeros(1, device=dev)
        torch.cuda.synchronize()
        context = nvml.process_bytes((os.getpid(),))  # the CUDA context alone, before any data
    chunks, left = [], args.bytes
    while left > 0:
        n = max(8, min(CHUNK, left) // 8 * 8)
        chunks.append(torch.empty(n, dtype=torch.uint8, device=dev).random_())
        left -= CHUNK
    if dev.type == "cuda":
        torch.cuda.synchronize()
    want = _sums(chunks)

    def refuse(*_: object) -> None:
        raise RuntimeError("the cuda backend parks this process through the driver; no command should reach it")

    client = WorkloadClient(args.agent, args.job, args.group, on_snapshot=refuse, on_restore=refuse, backend="cuda")
    try:
        client.wait_registered()
    except Exception as exc:  # the agent's refusal, for the bench to count and name
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        client.close()
        return
    print(json.dumps({"pid": os.getpid(), "bytes": sum(c.numel() for c in chunks), "context_bytes": context}),
          flush=True)
    for line in sys.stdin:
        if line.strip() == "verify":
            print(json.dumps({"identical": _sums(chunks) == want, "commands": len(client.commands)}), flush=True)
        elif line.strip() == "exit":
            break
    client.close()


def other_process(args: argparse.Namespace) -> None:
    """Another process on the device: free memory, a fill of the memory a park freed, the copy floor."""
    import torch

    cuda = args.device == "cuda"
    for line in sys.stdin:
        if line.strip() == "exit":
            break
        msg = json.loads(line)
        cmd = msg.get("cmd")
        out: dict = {}
        if cmd == "info":
            out = {"gpu": torch.cuda.get_device_name() if cuda else "", "torch": torch.__version__}
        elif cmd == "free":
            out = {"free": torch.cuda.mem_get_info()[0] if cuda else None}
        elif cmd == "fill":
            out = fill(int(msg["bytes"])) if cuda else {"ok": None, "why": "no device"}
        elif cmd == "floor":
            out = copy_floor(int(msg["bytes"])) if cuda else {}
        print(json.dumps(out), flush=True)


def fill(n: int) -> dict:
    """Allocate ``n`` bytes on the device, write a pattern, read it back, free it (returned to the driver)."""
    import torch

    n = n // 8 * 8
    t0 = time.perf_counter()
    try:
        x = torch.empty(n, dtype=torch.uint8, device="cuda")
        x.fill_(0x5A)
        ok = int(x.min()) == int(x.max()) == 0x5A
        del x
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return {"ok": ok, "bytes": n, "seconds": time.perf_counter() - t0}
    except Exception as exc:  # out of memory: the park did not give the memory back
        torch.cuda.empty_cache()
        return {"ok": False, "bytes": n, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def copy_floor(n: int, repeats: int = 3) -> dict:
    """D2H and H2D of ``n`` bytes into pre-pinned memory (the floor), into pageable memory (fresh: its
    pages faulted in by the copy, and touched), and the host's single-thread first-touch rate."""
    import ctypes
    import mmap

    import torch

    n = n // 8 * 8
    d = torch.empty(n, dtype=torch.uint8, device="cuda").fill_(1)

    def timed(fn, times: int = repeats) -> float:
        out = []
        for _ in range(times):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    res: dict = {"floor_bytes": n}
    t0 = time.perf_counter()
    buf = {"dev": d, "pinned": torch.empty(n, dtype=torch.uint8, pin_memory=True)}
    res["pin_GBps"] = n / 1e9 / (time.perf_counter() - t0)
    res["pinned_d2h_GBps"] = n / 1e9 / timed(lambda: buf["pinned"].copy_(buf["dev"], non_blocking=True))
    res["pinned_h2d_GBps"] = n / 1e9 / timed(lambda: buf["dev"].copy_(buf["pinned"], non_blocking=True))
    buf["pageable"] = torch.empty(n, dtype=torch.uint8)  # untouched: the first copy faults its pages in
    del buf["pinned"]
    res["pageable_fresh_d2h_GBps"] = n / 1e9 / timed(lambda: buf["pageable"].copy_(buf["dev"]), 1)
    res["pageable_d2h_GBps"] = n / 1e9 / timed(lambda: buf["pageable"].copy_(buf["dev"]), 1)
    res["pageable_h2d_GBps"] = n / 1e9 / timed(lambda: buf["dev"].copy_(buf["pageable"]), 1)
    buf.clear()
    del d
    torch.cuda.empty_cache()
    m = mmap.mmap(-1, n)  # fresh anonymous memory, as a driver's host buffer starts
    view = ctypes.c_char.from_buffer(m)
    t0 = time.perf_counter()
    ctypes.memset(ctypes.addressof(view), 1, n)
    res["host_first_touch_GBps"] = n / 1e9 / (time.perf_counter() - t0)
    del view
    m.close()
    return res


class Proc:
    def __init__(self, argv: list[str], name: str) -> None:
        self.name = name
        self.p = subprocess.Popen([sys.executable, SCRIPT, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        self.q: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.p.stdout:  # type: ignore[union-attr]
            if line.startswith("{"):
                self.q.put(json.loads(line))
        self.q.put(None)

    def read(self, timeout: float = 240) -> dict:
        try:
            msg = self.q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self.name} (pid {self.p.pid}) said nothing within {timeout:g} s") from None
        if msg is None:
            raise RuntimeError(f"{self.name} (pid {self.p.pid}) exited with {self.p.wait(10)}")
        return msg

    def send(self, cmd: str) -> None:
        self.p.stdin.write(cmd + "\n")  # type: ignore[union-attr]
        self.p.stdin.flush()  # type: ignore[union-attr]

    def ask(self, timeout: float = 240, **msg: object) -> dict:
        self.send(json.dumps(msg))
        return self.read(timeout)

    def close(self, wait: float = 30) -> None:
        try:
            self.send("exit")
            self.p.wait(wait)
        except Exception:
            self.p.kill()
            self.p.wait(10)


# ------------------------------------------------------------------ the driver, recorded


class Recorded:
    """The checkpoint API (real or fake), each call's pid and start/end times recorded."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self._lock = inner, [], threading.Lock()

    def driver_version(self) -> int:
        return self.inner.driver_version()

    def get_state(self, pid: int) -> int:
        return self.inner.get_state(pid)

    def _timed(self, call: str, fn, pid: int, *args) -> None:
        t0 = time.perf_counter()
        try:
            fn(pid, *args)
        finally:
            with self._lock:
                self.calls.append((call, pid, t0, time.perf_counter()))

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._timed("lock", self.inner.lock, pid, timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._timed("checkpoint", self.inner.checkpoint, pid)

    def restore(self, pid: int) -> None:
        self._timed("restore", self.inner.restore, pid)

    def unlock(self, pid: int) -> None:
        self._timed("unlock", self.inner.unlock, pid)

    def take(self) -> list[tuple[str, int, float, float]]:
        with self._lock:
            out, self.calls = self.calls, []
        return out


class FakeCudaDriver:
    """A fake (no GPU here): the checkpoint API's per-pid state machine, moving nothing, each step 20 ms.
    ``fail``: the step (lock, checkpoint, restore, unlock) that fails for the highest pid."""

    def __init__(self, fail: str = "") -> None:
        self.states: dict[int, int] = {}
        self.fail = fail
        self.pids: set[int] = set()

    def driver_version(self) -> int:
        return 12080

    def get_state(self, pid: int) -> int:
        return self.states.get(pid, 0)

    def _move(self, call: str, pid: int, want: int, to: int) -> None:
        from rota_agent.backends.cuda import CudaError

        time.sleep(0.02)
        self.pids.add(pid)
        if call == self.fail and pid == max(self.pids):
            raise CudaError(f"cuCheckpointProcess{call.title()}", 999, "FAKE_FAILURE (--fake-fail)")
        if self.get_state(pid) != want:
            raise CudaError(f"cuCheckpointProcess{call.title()}", 401, "CUDA_ERROR_ILLEGAL_STATE")
        self.states[pid] = to

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._move("lock", pid, 0, 1)

    def checkpoint(self, pid: int) -> None:
        self._move("checkpoint", pid, 1, 2)

    def restore(self, pid: int) -> None:
        self._move("restore", pid, 2, 1)

    def unlock(self, pid: int) -> None:
        self._move("unlock", pid, 1, 0)


def steps_of(calls: list[tuple[str, int, float, float]]) -> dict:
    """Per driver call: its pids, seconds by pid, the span from the first start to the last end, and the most
    in flight at once (several pids each taking as long as the span: the driver copied them side by side)."""
    out: dict = {}
    for call in ("lock", "checkpoint", "restore", "unlock"):
        mine = [c for c in calls if c[0] == call]
        if not mine:
            continue
        edges = sorted([(t0, 1) for _, _, t0, _ in mine] + [(t1, -1) for _, _, _, t1 in mine])
        now = most = 0
        for _, step in edges:
            now += step
            most = max(most, now)
        out[call] = {"pids": sorted(p for _, p, _, _ in mine),
                     "seconds": {str(p): round(t1 - t0, 4) for _, p, t0, t1 in mine},
                     "span_s": max(t1 for *_, t1 in mine) - min(t0 for _, _, t0, _ in mine), "at_once": most}
    return out


# ------------------------------------------------------------------ part 1: whole process


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
        pause = min(pause * 2, 0.02)
    raise TimeoutError(f"operation {op_id} pending after {timeout} s")


def refusal(exc: Exception) -> str:
    """An RPC's refusal (code and details) or another exception, in one line."""
    code = getattr(exc, "code", None)
    if callable(code) and callable(getattr(exc, "details", None)):
        return f"{code()}: {exc.details()}"  # type: ignore[attr-defined]
    return f"{type(exc).__name__}: {exc}"


class Case:
    """One (size, processes, parallel) case of part 1: its runs and its failures."""

    def __init__(self, size: int, procs: int, parallel: int, driver: str) -> None:
        self.out: dict = {"size_bytes": size, "procs": procs, "parallel": parallel, "driver": driver, "runs": [],
                          "failures": []}
        self.name = f"whole {size / 1e9:g} GB x{procs} parallel {parallel}"

    def fail(self, step: str, why: str) -> None:
        log.error("%s: %s failed: %s", self.name, step, why)
        self.out["failures"].append({"step": step, "error": why})


def whole_case(args: argparse.Namespace, other: Proc | None, floor: dict, size: int, procs: int,
               parallel: int) -> dict:
    """Register ``procs`` tenants of one job, then park, fill from another process, restore, verify."""
    import grpc

    from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
    from rota_agent import Agent, running_agent
    from rota_agent.backends import CudaBackend, LibCudaDriver

    real = args.driver == "real"
    case = Case(size, procs, parallel, args.driver)
    try:
        drv = Recorded(LibCudaDriver() if real else FakeCudaDriver(args.fake_fail))
    except Exception as exc:  # no libcuda, or no checkpoint API in it: say so, loudly
        case.fail("driver", f"{type(exc).__name__}: {exc}")
        return case.out
    job = f"whole-{size}-x{procs}-p{parallel}"
    sockets = tempfile.mkdtemp(prefix="rota-ab-")
    agent = Agent({"cuda": CudaBackend(lambda: drv, parallel=parallel, step_timeout_s=args.step_timeout)},
                  residue_max_bytes=args.residue_max_bytes)
    case.out["residue_max_bytes"] = agent.residue_max_bytes
    try:
        with running_agent(agent, socket_dir=sockets) as (ep, _), grpc.insecure_channel(ep) as ch:
            stub = sa_grpc.SnapshotAgentServiceStub(ch)
            argv = ["--role", "whole-tenant", "--bytes", str(size // procs), "--device", args.device,
                    "--agent", f"unix:{os.path.join(sockets, 'agent.sock')}", "--job", job, "--group", GROUP]
            tenants = [Proc(argv, f"tenant {i} of {job}") for i in range(procs)]
            try:  # the tenants end before the agent does
                try:
                    infos = [t.read() for t in tenants]
                except Exception as exc:
                    infos = [{"error": str(exc)}]
                refused = [i["error"] for i in infos if "error" in i]
                if refused:
                    case.fail("register", "; ".join(refused))
                    return case.out
                pids = sorted(i["pid"] for i in infos)
                context = {i["pid"]: i["context_bytes"] for i in infos}
                case.out.update(pids=pids, stored_bytes=sum(i["bytes"] for i in infos), context_bytes=context)
                for _ in range(args.repeats):
                    if not whole_run(case, stub, drv, tenants, other, context, job, real):
                        break
            finally:
                for t in tenants:
                    t.close(10)
    finally:
        shutil.rmtree(sockets, ignore_errors=True)
    runs = [r for r in case.out["runs"] if "restore_s" in r]
    if runs:
        med = statistics.median
        park, restore = med(r["park_s"] for r in runs), med(r["restore_s"] for r in runs)
        stored = case.out["stored_bytes"]
        case.out.update(park_s=park, restore_s=restore, park_GBps=stored / 1e9 / park,
                        restore_GBps=stored / 1e9 / restore)
        if floor.get("pinned_d2h_GBps"):
            case.out.update(park_floor_s=stored / 1e9 / floor["pinned_d2h_GBps"],
                            restore_floor_s=stored / 1e9 / floor["pinned_h2d_GBps"])
            case.out.update(park_vs_floor=park / case.out["park_floor_s"],
                            restore_vs_floor=restore / case.out["restore_floor_s"])
        log.warning("%s: park %.2f s (%.2f GB/s%s) restore %.2f s (%.2f GB/s%s)", case.name, park,
                    case.out["park_GBps"], f", {case.out['park_vs_floor']:.2f}x floor" if floor else "", restore,
                    case.out["restore_GBps"], f", {case.out['restore_vs_floor']:.2f}x floor" if floor else "")
    return case.out


def whole_run(case: Case, stub, drv: Recorded, tenants: list[Proc], other: Proc | None, context: dict,
              job: str, real: bool) -> bool:
    """One park and restore; False when the case cannot go on."""
    from rota import nvml
    from rota.wire import snapshot_agent_pb2 as sa
    from rota_agent_client.extension import ext

    pids = case.out["pids"]
    row: dict = {}
    case.out["runs"].append(row)
    free0 = other.ask(cmd="free")["free"] if other else None
    before = nvml.process_bytes_by_pid(tuple(pids)) if real else None
    row["nvml_before_park"] = before
    if real:
        per = case.out["size_bytes"] // len(pids)
        if before is None:
            case.fail("nvml", "NVML is not available here (nvidia-ml-py missing?): the release cannot be verified")
        elif any(before.get(p, 0) < per for p in pids):
            case.fail("nvml", f"NVML sees {before} bytes for pids holding {per} bytes each: the agent runs in "
                      "another pid namespace than the tenants, so its release check proves nothing")
    drv.take()
    t0 = time.perf_counter()
    try:
        got = wait_op(stub, stub.Snapshot(sa.SnapshotRequest(job_id=job, group=GROUP), timeout=60).operation_id)
    except Exception as exc:  # refused inside the RPC (not registered, no proven pid, unsupported)
        case.fail("park", refusal(exc))
        return False
    row.update(park_s=time.perf_counter() - t0, park_agent_ms=got.elapsed_ms, park_steps=steps_of(drv.take()))
    residue = residue_of(got, ext.GetOperationResponseExt)
    row["residue_after_park"] = residue
    if got.status != sa.OPERATION_STATUS_COMPLETE:
        case.fail("park", got.error or "operation failed without an error")
        return False
    parked = row["park_steps"].get("checkpoint", {}).get("pids", [])
    if parked != pids:
        case.fail("park", f"the driver checkpointed pids {parked}; the job's tenants are {pids}")
    if real:
        after = nvml.process_bytes_by_pid(tuple(pids))
        row["nvml_after_park"] = after
        for pid in pids:
            key = f"nvml:pid:{pid}"
            left = residue["by_key"].get(key)
            bound = (context.get(pid) or 0) + SLACK
            if left is None:
                case.fail("release", f"the agent's report has no {key}: it did not verify the release of pid {pid}")
            elif left > bound or (after or {}).get(pid, 0) > bound:
                case.fail("release", f"pid {pid} still holds {left} bytes (NVML here: {(after or {}).get(pid)}) "
                          f"after its park; at most its context + 256 MiB ({bound}) may stay")
    if other:
        free1 = other.ask(cmd="free")["free"]
        row.update(device_free_before=free0, device_free_after=free1)
        if free1 is not None:
            freed = row["freed_bytes"] = free1 - free0
            if freed < case.out["size_bytes"] * 0.95:
                case.fail("release", f"device free memory grew by {freed} bytes; the job held "
                          f"{case.out['size_bytes']}")
            row["other_process"] = filled = other.ask(cmd="fill", bytes=max(0, int(freed * 0.95)))
            if not filled["ok"]:
                case.fail("other-process", f"another process could not use the freed memory: {filled}")
    t1 = time.perf_counter()
    try:
        got = wait_op(stub, stub.Restore(sa.RestoreRequest(job_id=job, group=GROUP), timeout=60).operation_id)
    except Exception as exc:
        case.fail("restore", refusal(exc))
        return False
    took = time.perf_counter() - t1
    row.update(restore_agent_ms=got.elapsed_ms, restore_steps=steps_of(drv.take()))
    if got.status != sa.OPERATION_STATUS_COMPLETE:
        case.fail("restore", got.error or "operation failed without an error")
        return False
    row["restore_s"] = took
    checks = []
    for t in tenants:
        t.send("verify")
    for t in tenants:
        checks.append(t.read())
    row["bit_identical"] = all(c["identical"] for c in checks)
    if not row["bit_identical"]:
        case.fail("bytes", f"after the restore, tenants' bytes differ from before the park: {checks}")
    if any(c["commands"] for c in checks):
        case.fail("park", "the agent sent commands down a cuda job's channel; the driver should park it")
    log.warning("%s: park %.2f s, restore %.2f s, identical %s", case.name, row["park_s"], row["restore_s"],
                row["bit_identical"])
    return not case.out["failures"]


def whole_process(args: argparse.Namespace, sizes: list[int], result: dict, save) -> None:
    """Part 1: every (size, processes, parallel) case, the floor first, all measured from another process."""
    cuda = args.device == "cuda"
    other = Proc(["--role", "other", "--device", args.device], "the other process") if cuda else None
    try:
        floor = {}
        if other is not None:
            info = other.ask(cmd="info")
            result.update(gpu=info["gpu"], torch=info["torch"])
            floor = other.ask(cmd="floor", bytes=min(max(sizes), args.floor_max))
        result["whole_process_floor"] = floor
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                result["transparent_hugepage"] = f.read().strip()
        except OSError:
            pass
        if floor:
            log.warning("floor on %.1f GB: pinned D2H %.1f GB/s, H2D %.1f GB/s; pageable D2H fresh %.1f / "
                        "touched %.1f, H2D %.1f GB/s; host first touch %.1f GB/s; pinning %.1f GB/s",
                        floor["floor_bytes"] / 1e9, floor["pinned_d2h_GBps"], floor["pinned_h2d_GBps"],
                        floor["pageable_fresh_d2h_GBps"], floor["pageable_d2h_GBps"], floor["pageable_h2d_GBps"],
                        floor["host_first_touch_GBps"], floor["pin_GBps"])
        for size in sizes:
            for procs in args.procs:
                for parallel in (args.parallel if procs > 1 else [max(args.parallel)]):
                    try:
                        got = whole_case(args, other, floor, size, procs, parallel)
                    except Exception as exc:  # a tenant or the other process died, a bad knob: counted, named
                        log.exception("whole %d bytes x%d parallel %d crashed", size, procs, parallel)
                        got = Case(size, procs, parallel, args.driver).out
                        got["failures"].append({"step": "crash", "error": f"{type(exc).__name__}: {exc}"})
                    result["whole_process_cuda"].append(got)
                    for f in got["failures"]:
                        result["failures"].append({"part": "cuda", "size_bytes": size, "procs": procs,
                                                   "parallel": parallel, **f})
                    save()
    finally:
        if other is not None:
            other.close()

