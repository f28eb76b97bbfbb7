"""`rota orchestrator serve --etcd` as a real process against a real etcd member."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from etcd_testlib import Background, v1_acquire, v1_stub, v1_yield

import rota
from rota.testing import eventually, free_port
from rota.wire import timeslice_orchestrator_pb2 as v1a
from rota_etcd.testing import OrchestratorProcess

HERE = os.path.dirname(os.path.abspath(__file__))


def serve(etcd, tmp_path, child_env, *args: str, port: int | None = None, name: str = "orch") -> OrchestratorProcess:
    return OrchestratorProcess(etcd.url, tmp_path / f"{name}.log", args=["--ttl", "2", *args], env=child_env,
                               port=port).start()


def status_json(etcd, child_env, *args: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "rota", "status", "--etcd", etcd.url, "--json", *args],
                         capture_output=True, text=True, env=child_env, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_fifo_turns_fencing_tokens_and_status_from_etcd(etcd, tmp_path, child_env) -> None:
    orch = serve(etcd, tmp_path, child_env)
    gpus = [rota.connect(group="g", tenant=f"t{i}", endpoint=orch.endpoint) for i in range(3)]
    try:
        first = gpus[0].acquire()
        assert first.token == 1
        order: list[str] = []
        waiting = []
        for gpu in gpus[1:]:  # queue t1 then t2
            waiting.append(Background(lambda gpu=gpu: (gpu.acquire(), order.append(gpu.tenant))[0]))
            time.sleep(0.3)
        st = status_json(etcd, child_env, "g")["groups"][0]
        assert (st["holder"], st["token"], st["queue"]) == ("t0", 1, ["t1", "t2"])
        gpus[0].release()
        assert waiting[0].result().token == 2
        gpus[1].release()
        assert waiting[1].result().token == 3
        assert order == ["t1", "t2"]
        gpus[2].release()
        st = status_json(etcd, child_env)["groups"][0]
        assert st["token"] == 3 and st["holder"] == "" and st["switches"] == 2
    finally:
        for gpu in gpus:
            gpu.close()
        orch.stop()


def test_v1alpha1_clients_and_bad_input(etcd, tmp_path, child_env) -> None:
    orch = serve(etcd, tmp_path, child_env)
    ch, stub = v1_stub(orch.endpoint)
    try:
        r = stub.Acquire(v1a.AcquireRequest(job_id="a", group_id="w"), timeout=10)
        assert r.success
        again = stub.Acquire(v1a.AcquireRequest(job_id="a", group_id="w"), timeout=2)  # idempotent, at once
        assert again.success and again.waited_ms == 0
        assert "w" in stub.ListGroups(v1a.ListGroupsRequest()).group_ids
        st = stub.GetGroupStatus(v1a.GetGroupStatusRequest(group_id="w")).group
        assert (st.locking_job, st.group_state) == ("a", v1a.GroupStatus.State.STATE_LOCKED)
        cases = [
            (lambda: stub.Acquire(v1a.AcquireRequest(job_id="", group_id="w"), timeout=5),
             grpc.StatusCode.INVALID_ARGUMENT, "job_id"),
            (lambda: stub.Acquire(v1a.AcquireRequest(job_id="a b", group_id="w"), timeout=5),
             grpc.StatusCode.INVALID_ARGUMENT, "'a b'"),
            (lambda: stub.Yield(v1a.YieldRequest(job_id="b", group_id="w"), timeout=5),
             grpc.StatusCode.PERMISSION_DENIED, "'b'"),
            (lambda: stub.GetGroupStatus(v1a.GetGroupStatusRequest(group_id="nope"), timeout=5),
             grpc.StatusCode.NOT_FOUND, "'nope'"),
        ]
        for call, code, named in cases:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == code and named in info.value.details()
        y = stub.Yield(v1a.YieldRequest(job_id="a", group_id="w"), timeout=5)
        assert y.success and y.snapshot_deferred and y.pending_waiters == 0
    finally:
        ch.close()
        orch.stop()

    fixed = serve(etcd, tmp_path, child_env, "--groups", "only", name="fixed")
    try:
        with pytest.raises(grpc.RpcError) as info:
            v1_acquire(fixed.endpoint, "a", "other")
        assert info.value.code() == grpc.StatusCode.NOT_FOUND and "'other'" in info.value.details()
        assert v1_acquire(fixed.endpoint, "a", "only").success
    finally:
        fixed.stop()


def test_unreachable_etcd_at_start_is_a_clear_error_naming_the_endpoints(child_env) -> None:
    dead = f"http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "rota", "orchestrator", "serve", "--etcd", dead,
                          "--listen", f"127.0.0.1:{free_port()}", "--insecure"], capture_output=True, text=True,
                         env=child_env, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "cannot reach etcd at " + ", ".join(dead.split(",")) in out.stderr
    assert "Traceback" not in out.stderr
    assert time.monotonic() - t0 < 20
    bad = subprocess.run([sys.executable, "-m", "rota", "orchestrator", "serve", "--etcd", "ftp://x"],
                         capture_output=True, text=True, env=child_env, timeout=30)
    assert bad.returncode == 2 and "'ftp://x' is not an etcd client URL" in bad.stderr


def test_restarting_the_orchestrator_loses_no_holder_and_no_queue_position(etcd, tmp_path, child_env) -> None:
    port = free_port()
    orch = serve(etcd, tmp_path, child_env, port=port, name="first")
    gpus = [rota.connect(group="r", tenant=f"t{i}", endpoint=orch.endpoint) for i in range(3)]
    try:
        assert gpus[0].acquire().token == 1
        assert v1_acquire(orch.endpoint, "v1-job", "v1grp").success  # a v1alpha1 holder, no keepalive
        waiting = []
        for gpu in gpus[1:]:
            waiting.append(Background(gpu.acquire))
            time.sleep(0.3)
        orch.kill(signal.SIGKILL)
        time.sleep(0.5)
        orch = serve(etcd, tmp_path, child_env, port=port, name="second")
        time.sleep(3)  # more than the TTL: live tenants re-attached and kept their places
        st = {g["group_id"]: g for g in status_json(etcd, child_env)["groups"]}
        assert (st["r"]["holder"], st["r"]["queue"]) == ("t0", ["t1", "t2"])
        assert st["v1grp"]["holder"] == "v1-job"
        assert not any(w.done() for w in waiting)
        gpus[0].release()
        assert waiting[0].result().token == 2
        gpus[1].release()
        assert waiting[1].result().token == 3
        gpus[2].release()
        assert v1_yield(orch.endpoint, "v1-job", "v1grp").success
    finally:
        for gpu in gpus:
            gpu.close()
        orch.stop()


def test_a_killed_holder_loses_its_turn_within_the_ttl(etcd, tmp_path, child_env) -> None:
    orch = serve(etcd, tmp_path, child_env)
    log = tmp_path / "tenants.log"
    holder = subprocess.Popen([sys.executable, os.path.join(HERE, "etcd_tenant.py"), "--endpoint", orch.endpoint,
                               "--group", "k", "--job", "doomed", "--log", str(log), "--hold"],
                              stdout=subprocess.PIPE, text=True, env=child_env)
    waiter = rota.connect(group="k", tenant="next", endpoint=orch.endpoint)
    try:
        assert holder.stdout.readline().strip() == "holding"
        pending = Background(waiter.acquire)
        time.sleep(0.5)
        assert not pending.done()
        t0 = time.monotonic()
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait(10)
        grant = pending.result(timeout=15)
        assert grant.token == 2
        assert time.monotonic() - t0 < 2 + 2.5  # TTL 2 s, plus etcd's expiry sweep and slack
        st = status_json(etcd, child_env, "k")["groups"][0]
        assert {t["job_id"]: t["state"] for t in st["tenants"]}["doomed"] == "lost"
        waiter.release()
    finally:
        if holder.poll() is None:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(10)
        waiter.close()
        orch.stop()


def test_rota_status_etcd_needs_a_reachable_etcd_and_names_unknown_groups(etcd, child_env) -> None:
    out = subprocess.run([sys.executable, "-m", "rota", "status", "--etcd", etcd.url, "no-such-group"],
                         capture_output=True, text=True, env=child_env, timeout=30)
    assert out.returncode != 0 and "'no-such-group' does not exist" in out.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run([sys.executable, "-m", "rota", "status", "--etcd", dead], capture_output=True, text=True,
                         env=child_env, timeout=60)
    assert out.returncode != 0 and f"cannot reach etcd at {dead}" in out.stderr and "Traceback" not in out.stderr


def test_priorities_and_gpu_time_live_in_etcd_and_order_the_queue_after_a_restart(etcd, tmp_path, child_env) -> None:
    port = free_port()
    orch = serve(etcd, tmp_path, child_env, "--policy", "priority", port=port, name="prio1")
    holder = rota.connect(group="p", tenant="holder", endpoint=orch.endpoint)
    low = rota.connect(group="p", tenant="low", endpoint=orch.endpoint, priority=0)
    high = rota.connect(group="p", tenant="high", endpoint=orch.endpoint, priority=5)
    try:
        holder.acquire()
        time.sleep(0.2)
        waiting_low = Background(low.acquire)
        time.sleep(0.3)
        waiting_high = Background(high.acquire)  # arrives later, but ranks higher
        eventually(lambda: status_json(etcd, child_env, "p")["groups"][0]["queue"] == ["low", "high"],
                   "both waiters queued in etcd", timeout=10)
        orch.kill(signal.SIGKILL)
        orch = serve(etcd, tmp_path, child_env, "--policy", "priority", port=port, name="prio2")
        st = status_json(etcd, child_env, "p")["groups"][0]
        prios = {t["job_id"]: t.get("priority", 0) for t in st["tenants"]}
        assert st["queue"] == ["low", "high"] and prios["high"] == 5
        holder.release()
        assert waiting_high.result().token == 2
        assert not waiting_low.done()
        time.sleep(0.2)
        high.release()
        assert waiting_low.result().token == 3
        low.release()
        st = status_json(etcd, child_env, "p")["groups"][0]
        gpu = {t["job_id"]: t["gpu_seconds"] for t in st["tenants"]}
        assert gpu["holder"] > 0.5 and gpu["high"] > 0.1  # GPU time for fair share, kept across the restart
    finally:
        for gpu_ in (holder, low, high):
            gpu_.close()
        orch.stop()
