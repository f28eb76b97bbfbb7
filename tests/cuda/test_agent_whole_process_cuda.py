"""The agent's whole-process backend on a real GPU: tenant processes register as a real job does (a
``rota_agent_client.WorkloadClient`` with backend cuda over the agent's Unix socket, each pid proven by its
door), the agent parks them through the CUDA driver's checkpoint API, NVML of every parked pid falls to at
most its CUDA context + 256 MiB, another process (this one) allocates and fills the freed memory, and the
restore brings back every byte.

A driver without the checkpoint API fails these tests (the agent's refusal is the failure), except that
they skip, saying so, when ``libcuda.so.1`` has no ``cuCheckpointProcessLock`` at all (a driver before 570).
This file is also the tenant: ``python test_agent_whole_process_cuda.py --bytes N --agent unix:... --job J``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import ctypes
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

MIB = 1 << 20
CHUNK = 1 << 30
LIMIT = 256 * MIB  # what a parked pid may still hold beside its CUDA context (the figure)
SIZE = 2 * 10**9
GROUP = "cuda-tier"


def _sums(chunks: list[torch.Tensor]) -> list[list[int]]:
    return [[int(t.view(torch.int64).sum()), int(t.view(torch.int32).sum(dtype=torch.int64))] for t in chunks]


def tenant(argv: list[str]) -> None:
    """Holds ``--bytes`` of random device data; registered with the agent for whole-process parking."""
    ap = argparse.ArgumentParser()
    for a in ("--agent", "--job"):
        ap.add_argument(a, required=True)
    ap.add_argument("--bytes", type=int, required=True)
    args = ap.parse_args(argv)
    from rota import nvml
    from rota_agent_client import WorkloadClient

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    context = nvml.process_bytes((os.getpid(),))
    chunks, left = [], args.bytes
    while left > 0:
        chunks.append(torch.empty(min(CHUNK, left) // 8 * 8, dtype=torch.uint8, device="cuda").random_())
        left -= CHUNK
    torch.cuda.synchronize()
    want = _sums(chunks)

    def refuse(*_: object) -> None:
        raise RuntimeError("a cuda job is parked by the driver; no command should reach it")

    client = WorkloadClient(args.agent, args.job, GROUP, on_snapshot=refuse, on_restore=refuse, backend="cuda")
    try:
        client.wait_registered()
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return
    print(json.dumps({"pid": os.getpid(), "bytes": sum(c.numel() for c in chunks), "context": context}), flush=True)
    for line in sys.stdin:
        if line.strip() == "verify":
            print(json.dumps({"identical": _sums(chunks) == want, "commands": len(client.commands)}), flush=True)
        elif line.strip() == "exit":
            break
    client.close()


@pytest.fixture(scope="module", autouse=True)
def checkpoint_api() -> None:
    """Skip only when the driver predates the checkpoint API; any other trouble fails the tests."""
    lib = ctypes.CDLL("libcuda.so.1")  # a CUDA machine without libcuda fails here, loudly
    if not hasattr(lib, "cuCheckpointProcessLock"):
        version = ctypes.c_int()
        lib.cuDriverGetVersion(ctypes.byref(version))
        pytest.skip(f"libcuda.so.1 (CUDA driver API {version.value}) has no cuCheckpointProcessLock: the process "
                    "checkpoint API needs NVIDIA driver 570 or newer")


@contextlib.contextmanager
def served(parallel: int | None = None) -> Iterator[tuple[Any, str]]:
    """An agent (its default backends, or a cuda backend driving ``parallel`` pids at once) on loopback and on
    a socket directory; yields (stub, unix address of its socket)."""
    import grpc

    from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
    from rota_agent import Agent, running_agent
    from rota_agent.backends import CudaBackend

    sockets = tempfile.mkdtemp(prefix="rota-ct-")
    agent = Agent() if parallel is None else Agent({"cuda": CudaBackend(parallel=parallel)})
    try:
        with running_agent(agent, socket_dir=sockets) as (ep, _), grpc.insecure_channel(ep) as ch:
            yield sa_grpc.SnapshotAgentServiceStub(ch), f"unix:{os.path.join(sockets, 'agent.sock')}"
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


@contextlib.contextmanager
def tenants(agent: str, job: str, n: int, nbytes: int) -> Iterator[list[Any]]:
    from rota.testing import ScriptedProcess

    args = ["--agent", agent, "--job", job, "--bytes", str(nbytes)]
    with concurrent.futures.ThreadPoolExecutor(n) as pool:  # they start (import torch, fill memory) at once
        started = [pool.submit(ScriptedProcess, __file__, args, dict(os.environ), timeout=120) for _ in range(n)]
    procs = [f.result() for f in started if f.exception() is None]
    try:
        for f in started:
            if f.exception() is not None:
                raise f.exception()  # type: ignore[misc]
        for p in procs:
            assert "error" not in p.ready, f"the agent refused a tenant: {p.ready['error']}"
        yield procs
    finally:
        for p in procs:
            p.stop()


def wait(stub: Any, op_id: str, timeout: float = 120) -> Any:
    from rota.wire import snapshot_agent_pb2 as sa

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        got = stub.GetOperation(sa.GetOperationRequest(operation_id=op_id), timeout=10)
        if got.status != sa.OPERATION_STATUS_PENDING:
            return got
        time.sleep(0.01)
    raise AssertionError(f"operation {op_id} still pending after {timeout} s")


def cycle(stub: Any, job: str, procs: list[Any]) -> dict[str, Any]:
    """Park the job, check what its pids hold, fill the freed memory from this process, restore, verify."""
    from rota import nvml
    from rota.wire import snapshot_agent_pb2 as sa
    from rota_agent_client.extension import ext, read

    pids = sorted(p.ready["pid"] for p in procs)
    held = sum(p.ready["bytes"] for p in procs)
    context = {p.ready["pid"]: p.ready["context"] or 0 for p in procs}
    before = nvml.process_bytes_by_pid(tuple(pids))
    assert before is not None, "NVML unavailable here (nvidia-ml-py missing?): the release cannot be verified"
    for p in procs:
        assert before[p.ready["pid"]] >= p.ready["bytes"], \
            f"NVML sees {before} for tenants holding {held} bytes: another pid namespace? Nothing to verify"
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    got = wait(stub, stub.Snapshot(sa.SnapshotRequest(job_id=job, group=GROUP), timeout=60).operation_id)
    park_s = time.perf_counter() - t0
    assert got.status == sa.OPERATION_STATUS_COMPLETE, f"park failed: {got.error}"
    reported = dict(read(got, ext.GetOperationResponseExt).residue.bytes)
    after = nvml.process_bytes_by_pid(tuple(pids)) or {}
    for pid in pids:
        assert f"nvml:pid:{pid}" in reported, f"the agent did not verify pid {pid}'s release: {reported}"
        for left in (reported[f"nvml:pid:{pid}"], after.get(pid, 0)):
            assert left <= context[pid] + LIMIT, f"parked pid {pid} still holds {left} bytes (context {context[pid]})"
    free1 = torch.cuda.mem_get_info()[0]
    assert free1 - free0 >= held, f"the park freed {free1 - free0} bytes of the {held} the job held"
    x = torch.empty(int((free1 - free0) * 0.95) // 8 * 8, dtype=torch.uint8, device="cuda")  # another process
    x.fill_(0x5A)
    filled = int(x.min()) == int(x.max()) == 0x5A
    del x
    torch.cuda.empty_cache()
    assert filled
    t1 = time.perf_counter()
    got = wait(stub, stub.Restore(sa.RestoreRequest(job_id=job, group=GROUP), timeout=60).operation_id)
    restore_s = time.perf_counter() - t1
    assert got.status == sa.OPERATION_STATUS_COMPLETE, f"restore failed: {got.error}"
    checks = [p.ask("verify") for p in procs]
    assert all(c["identical"] for c in checks), f"bytes differ after the restore: {checks}"
    assert not any(c["commands"] for c in checks), "the agent sent a cuda job commands down its channel"
    return {"pids": pids, "bytes": held, "park_s": park_s, "restore_s": restore_s, "park_GBps": held / 1e9 / park_s,
            "restore_GBps": held / 1e9 / restore_s, "freed_bytes": free1 - free0, "nvml_before": before,
            "nvml_after": after, "agent_report": reported, "context_bytes": context}


def test_a_registered_process_parks_to_nothing_and_restores_bit_identically(record: Any) -> None:
    with served() as (stub, sock), tenants(sock, "whole-one", 1, SIZE) as procs:
        cycles = [cycle(stub, "whole-one", procs) for _ in range(2)]  # the second park of a restored process
    record(size_bytes=SIZE, cycles=cycles)


@pytest.mark.parametrize("parallel", [1, 8])
def test_two_processes_of_one_job_park_and_restore_together(parallel: int, record: Any) -> None:
    job = f"whole-two-p{parallel}"
    with served(parallel) as (stub, sock), tenants(sock, job, 2, SIZE // 2) as procs:
        got = cycle(stub, job, procs)
    assert len(got["pids"]) == 2
    record(size_bytes=SIZE, parallel=parallel, **got)


if __name__ == "__main__":
    tenant(sys.argv[1:])
