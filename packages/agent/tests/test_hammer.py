"""Many concurrent Status / Snapshot / Restore / GetOperation calls from several threads
against a real agent with real registered tenants (noop and app_channel): every call
gets a result or a clear error, nothing is left mid-transition, and the agent still
parks and restores correctly afterwards. Bounded by iteration count and pytest's timeout."""

from __future__ import annotations

import random
import threading

import grpc
import pytest
from agentlib import jobs, run_op, wait_op

from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import Agent, running_agent
from rota_agent.backends import AppChannelBackend, NoopBackend

THREADS, CALLS = 4, 60
# The errors a well-formed call may get here, and the words that make each one clear.
ALLOWED = {grpc.StatusCode.ABORTED: "in flight", grpc.StatusCode.FAILED_PRECONDITION: "FAULTED"}


@pytest.mark.timeout(240)
def test_concurrent_calls_all_complete_and_leave_no_job_transitioning(tenants):
    agent = Agent({"noop": NoopBackend(delay_s=0.005), "app_channel": AppChannelBackend()})
    with running_agent(agent) as (ep, _), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        procs = {}
        for job, backend in (("ch-a", "app_channel"), ("ch-b", "app_channel"), ("nop-a", "noop"),
                             ("nop-b", "noop")):
            procs[job] = tenants("--mode", "v1", "--orch", "127.0.0.1:1", "--agent", ep, "--job", job,
                                 "--group", "g", "--backend", backend)
        names = sorted(procs)
        ops: list[str] = []
        results: list[tuple[str, str]] = []  # (call, "ok" | code name)
        bad: list[str] = []
        lock = threading.Lock()  # guards the three lists above (test-side only)

        def hammer(seed: int) -> None:
            rnd = random.Random(seed)
            for _ in range(CALLS):
                call, job = rnd.choice(("status", "snapshot", "restore", "get")), rnd.choice(names)
                try:
                    if call == "status":
                        stub.Status(sa.StatusRequest(), timeout=30)
                    elif call == "get":
                        with lock:
                            known = list(ops)
                        if known:
                            stub.GetOperation(sa.GetOperationRequest(operation_id=rnd.choice(known)), timeout=30)
                    else:
                        req = (sa.SnapshotRequest if call == "snapshot" else sa.RestoreRequest)(job_id=job, group="g")
                        op = getattr(stub, call.capitalize())(req, timeout=30).operation_id
                        with lock:
                            ops.append(op)
                    outcome = "ok"
                except grpc.RpcError as exc:
                    outcome = exc.code().name
                    words = ALLOWED.get(exc.code())
                    if words is None or words not in (exc.details() or "") or job not in exc.details():
                        with lock:
                            bad.append(f"{call} {job}: {exc.code().name}: {exc.details()}")
                with lock:
                    results.append((call, outcome))

        threads = [threading.Thread(target=hammer, args=(i,), name=f"hammer-{i}") for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not bad, bad[:5]
        assert len(results) == THREADS * CALLS
        assert any(c == "snapshot" and o == "ok" for c, o in results)
        assert any(c == "restore" and o == "ok" for c, o in results)

        finished = [wait_op(stub, op) for op in ops]  # every operation ends, and none failed
        assert [f.error for f in finished if f.status != sa.OPERATION_STATUS_COMPLETE] == []
        states = jobs(stub)
        assert set(states) == set(names)
        assert not [j for j, (st, _) in states.items() if st in (sa.JOB_STATE_TRANSITIONING, sa.JOB_STATE_FAULTED)]

        for job in names:  # the agent still serves a clean park and restore
            assert run_op(stub, "snapshot", job).status == sa.OPERATION_STATUS_COMPLETE
            assert jobs(stub)[job][0] == sa.JOB_STATE_SAVED
            assert run_op(stub, "restore", job).status == sa.OPERATION_STATUS_COMPLETE
            assert jobs(stub)[job][0] == sa.JOB_STATE_RUNNING
        for job in ("ch-a", "ch-b"):
            check = procs[job].ask("check")
            assert check["on_device"] and check["identical"] and check["parks"] == check["restores"] >= 1
