"""HA: replicas against a 3-member etcd cluster; leader loss, a paused leader, etcd member and quorum loss."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from etcd_testlib import Background, v1_stub
from grpc_health.v1 import health_pb2, health_pb2_grpc

import rota
from rota.testing import eventually
from rota.wire import timeslice_orchestrator_pb2 as v1a
from rota_etcd.testing import OrchestratorProcess, leader_of

LEADER_SERVICE = "rota.leader"


def replicas(etcd, tmp_path, child_env, n: int = 2) -> list[OrchestratorProcess]:
    return [OrchestratorProcess(etcd.url, tmp_path / f"orch{i}.log", args=["--ttl", "3"], env=child_env).start()
            for i in range(n)]


def leader_and_followers(etcd, prefix: str, orchs: list[OrchestratorProcess]
                         ) -> tuple[OrchestratorProcess, list[OrchestratorProcess]]:
    def find() -> OrchestratorProcess | None:
        rec = leader_of(etcd.url, prefix)
        leader = next((o for o in orchs if rec and rec["address"] == o.endpoint and o.running), None)
        # elected in etcd is not yet serving: it loads state first, and says so through health
        if leader is None:
            return None
        try:
            serving = health(leader.endpoint, LEADER_SERVICE) == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            serving = False
        return leader if serving else None

    leader = eventually(find, "a leader among the replicas", timeout=20)
    return leader, [o for o in orchs if o is not leader]


def endpoints(orchs: list[OrchestratorProcess]) -> str:
    return ",".join(o.endpoint for o in orchs)


def retried(call: Callable[[], Any], within: float = 20.0) -> Any:
    """A v1alpha1 client's retry loop: re-send on UNAVAILABLE. A retried Yield that finds
    the turn already given back (PERMISSION_DENIED) went through on an earlier try: None."""
    deadline = time.monotonic() + within
    tries = 0
    while True:
        tries += 1
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.PERMISSION_DENIED and tries > 1:
                return None
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def health(endpoint: str, service: str) -> int:
    with grpc.insecure_channel(endpoint) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def test_followers_refuse_with_the_leader_address_and_rota_clients_follow(etcd3, tmp_path, child_env, prefix) -> None:
    orchs = replicas(etcd3, tmp_path, child_env)
    try:
        leader, (follower,) = leader_and_followers(etcd3, prefix, orchs)
        ch, stub = v1_stub(follower.endpoint)
        with ch:
            with pytest.raises(grpc.RpcError) as info:
                stub.Acquire(v1a.AcquireRequest(job_id="j", group_id="g"), timeout=5)
            err = info.value
            assert err.code() == grpc.StatusCode.UNAVAILABLE
            assert f"the leader is at {leader.endpoint}" in err.details() and "'j'" in err.details()
            assert dict(err.trailing_metadata())["rota-leader"] == leader.endpoint
            # reads are answered by followers too, from etcd
            assert list(stub.ListGroups(v1a.ListGroupsRequest(), timeout=5).group_ids) == []

        # grpc.health.v1: the orchestrator services are SERVING on every replica that answers (the
        # follower redirects: a readiness probe on them keeps both in the Service); "rota.leader"
        # only on the leader; the process ("") everywhere (liveness)
        service = "timeslice_orchestrator.v1alpha1.TimeSliceOrchestratorService"
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        assert health(leader.endpoint, service) == serving
        assert eventually(lambda: health(follower.endpoint, service) == serving, "the follower ready", timeout=10)
        assert health(leader.endpoint, LEADER_SERVICE) == serving
        assert health(follower.endpoint, LEADER_SERVICE) == not_serving
        assert health(follower.endpoint, "") == serving

        gpu = rota.connect(group="g", tenant="j", endpoint=endpoints([follower, leader]))  # follower listed first
        try:
            assert gpu.acquire().token == 1
            gpu.release()
        finally:
            gpu.close()
    finally:
        for o in orchs:
            o.stop()


def test_killing_the_leader_keeps_the_holder_and_the_queue_order(etcd3, tmp_path, child_env, prefix) -> None:
    orchs = replicas(etcd3, tmp_path, child_env, 3)
    eps = endpoints(orchs)
    gpus = [rota.connect(group="g", tenant=f"t{i}", endpoint=eps) for i in range(3)]
    try:
        assert gpus[0].acquire().token == 1
        waiting = []
        for gpu in gpus[1:]:
            waiting.append(Background(gpu.acquire))
            time.sleep(0.3)
        leader, _ = leader_and_followers(etcd3, prefix, orchs)
        t0 = time.monotonic()
        leader.kill(signal.SIGKILL)
        leader_and_followers(etcd3, prefix, [o for o in orchs if o is not leader])
        takeover = time.monotonic() - t0
        assert takeover < 2 + 3, f"no new leader {takeover:.1f} s after the old one died (lease TTL 2 s)"
        time.sleep(1.0)
        assert not any(w.done() for w in waiting), "a waiter was granted while t0 still holds"
        gpus[0].release()  # follows the new leader
        assert waiting[0].result().token == 2
        gpus[1].release()
        assert waiting[1].result().token == 3
        gpus[2].release()
    finally:
        for gpu in gpus:
            gpu.close()
        for o in orchs:
            o.stop()


def test_a_paused_leader_is_deposed_and_never_grants_after_it_wakes(etcd3, tmp_path, child_env, prefix) -> None:
    orchs = replicas(etcd3, tmp_path, child_env)
    try:
        old, (other,) = leader_and_followers(etcd3, prefix, orchs)
        ch, stub = v1_stub(old.endpoint)
        with ch:
            assert stub.Acquire(v1a.AcquireRequest(job_id="a", group_id="p"), timeout=10).success
        os.kill(old.proc.pid, signal.SIGSTOP)  # a GC pause, a frozen VM...
        try:
            new, _ = leader_and_followers(etcd3, prefix, [other])
            ch, stub = v1_stub(new.endpoint)
            with ch:  # the new leader may still be loading state: clients retry UNAVAILABLE
                yielded = retried(lambda: stub.Yield(v1a.YieldRequest(job_id="a", group_id="p"), timeout=10))
                assert yielded is None or yielded.success
                assert retried(lambda: stub.Acquire(v1a.AcquireRequest(job_id="b", group_id="p"), timeout=10)).success
        finally:
            os.kill(old.proc.pid, signal.SIGCONT)
        ch, stub = v1_stub(old.endpoint)
        with ch:  # the old leader wakes believing it leads, with "a" holding and "p" free for "c"
            with pytest.raises(grpc.RpcError) as info:
                stub.Acquire(v1a.AcquireRequest(job_id="c", group_id="p"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as info:  # "a" held p in its memory: no re-grant from memory
                stub.Acquire(v1a.AcquireRequest(job_id="a", group_id="p"), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        ch, stub = v1_stub(new.endpoint)
        with ch:
            st = stub.GetGroupStatus(v1a.GetGroupStatusRequest(group_id="p"), timeout=10).group
            assert st.locking_job == "b"
        assert "stops leading" in old.log_tail()
    finally:
        for o in orchs:
            o.stop()


def test_etcd_member_loss_is_survived_and_quorum_loss_answers_unavailable_never_a_grant(
        etcd3, tmp_path, child_env, prefix) -> None:
    orch = replicas(etcd3, tmp_path, child_env, 1)[0]
    ch, stub = v1_stub(orch.endpoint)
    try:
        with ch:
            assert stub.Acquire(v1a.AcquireRequest(job_id="a", group_id="q"), timeout=10).success
            etcd3.kill(0)  # one member of three: service continues (after etcd elects a new raft
            # leader if it lost its own; meanwhile calls may answer UNAVAILABLE, and clients retry)
            yielded = retried(lambda: stub.Yield(v1a.YieldRequest(job_id="a", group_id="q"), timeout=15))
            assert yielded is None or yielded.success  # None: an earlier try went through
            assert retried(lambda: stub.Acquire(v1a.AcquireRequest(job_id="b", group_id="q"), timeout=15)).success

            etcd3.kill(1)  # quorum lost: every answer is UNAVAILABLE, never a grant
            time.sleep(1.0)
            for job, group in (("c", "idle-group"), ("d", "q")):
                with pytest.raises(grpc.RpcError) as info:
                    stub.Acquire(v1a.AcquireRequest(job_id=job, group_id=group), timeout=15)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "etcd" in info.value.details() or "lead" in info.value.details()
                assert f"job={job!r}" in info.value.details() and f"group={group!r}" in info.value.details()

            etcd3.restart(0)
            etcd3.restart(1)

            def resumed() -> bool:
                try:
                    return stub.Acquire(v1a.AcquireRequest(job_id="e", group_id="after"), timeout=5).success
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    return False

            eventually(resumed, "service after etcd regained quorum", timeout=30)
            # b kept its turn throughout (a write that timed out may still land later in etcd,
            # so d may sit in the queue now: it is never granted while b holds)
            st = stub.GetGroupStatus(v1a.GetGroupStatusRequest(group_id="q"), timeout=10).group
            assert st.locking_job == "b"
            assert stub.Yield(v1a.YieldRequest(job_id="b", group_id="q"), timeout=10).success
    finally:
        orch.stop()
