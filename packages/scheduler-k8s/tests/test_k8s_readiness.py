"""The orchestrator Deployment becomes healthy: its probes, asked of real orchestrator replicas.

Real etcd and `rota orchestrator serve --etcd` processes; each probe is what the kubelet
sends for the rendered Deployment (grpc.health.v1 Check with the probe's ``service``).
What Kubernetes itself would do with the answers — count ready pods, surge one pod in a
rollout, let the PDB allow an eviction — is computed here from the rendered objects,
because no API server can run on the test machines (see the package README, "Tests").
"""

from __future__ import annotations

import os
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

import rota
from rota.testing import free_port
from rota_k8s import load_values, render
from rota_k8s.manifests import LEADER_HEALTH

etcd_testing = pytest.importorskip("rota_etcd.testing")
pytestmark = [pytest.mark.etcd,
              pytest.mark.skipif(not etcd_testing.etcd_available(), reason="needs the etcd binary")]


def eventually(check: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout:g} s")
        time.sleep(0.1)
    return value


def answers(endpoint: str, service: str) -> bool:
    """The kubelet's gRPC probe: SERVING passes; NOT_SERVING, an error or no answer fails."""
    with grpc.insecure_channel(endpoint) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


class Deployment:
    """The rendered orchestrator Deployment and its PDB, with pods that are real replicas."""

    def __init__(self, objs: list[dict[str, Any]], etcd_url: str, folder: Any, env: dict[str, str]) -> None:
        dep = next(o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] == "rota-orchestrator")
        pdb = next(o for o in objs if o["kind"] == "PodDisruptionBudget" and o["metadata"]["name"] ==
                   "rota-orchestrator")
        container = dep["spec"]["template"]["spec"]["containers"][0]
        self.replicas = dep["spec"]["replicas"]
        self.surge = dep["spec"]["strategy"]["rollingUpdate"]["maxSurge"]
        self.max_unavailable = dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"]
        self.pdb_max_unavailable = pdb["spec"]["maxUnavailable"]
        self.ready_service = container["readinessProbe"]["grpc"]["service"]
        self.live_service = container["livenessProbe"]["grpc"].get("service", "")
        self.etcd_url, self.folder, self.env = etcd_url, folder, env
        self.pods: list[Any] = []
        self.made = 0

    def start_pod(self) -> Any:
        self.made += 1
        metrics = f"127.0.0.1:{free_port()}"
        pod = etcd_testing.OrchestratorProcess(self.etcd_url, self.folder / f"pod{self.made}.log",
                                               args=["--ttl", "3", "--metrics-listen", metrics], env=self.env).start()
        pod.metrics_url = f"http://{metrics}/metrics"
        self.pods.append(pod)
        return pod

    def delete_pod(self, pod: Any) -> None:
        """What the kubelet does: SIGTERM (a leader resigns), then the pod is gone."""
        pod.stop()
        self.pods.remove(pod)

    def ready(self) -> list[Any]:
        return [p for p in self.pods if answers(p.endpoint, self.ready_service)]

    def leaders(self) -> list[Any]:
        return [p for p in self.pods if answers(p.endpoint, LEADER_HEALTH)]

    def disruptions_allowed(self) -> int:
        """The PDB's status.disruptionsAllowed (maxUnavailable form): healthy pods beyond replicas - maxUnavailable."""
        return max(0, len(self.ready()) - (self.replicas - self.pdb_max_unavailable))

    def all_ready(self, n: int) -> bool:
        return len(self.ready()) == n and len(self.leaders()) == 1


@pytest.fixture
def deployment(tmp_path) -> Any:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env.update(ROTA_ETCD_PREFIX=f"/rota-test/{uuid.uuid4().hex[:10]}", ROTA_ETCD_LEADER_TTL="2",
               ROTA_RUNTIME_DIR=str(tmp_path / "runtime"), PYTHONUNBUFFERED="1")
    with etcd_testing.EtcdCluster(tmp_path / "etcd", size=1) as etcd:
        d = Deployment(render(load_values()), etcd.url, tmp_path, env)
        try:
            yield d
        finally:
            for pod in list(d.pods):
                d.delete_pod(pod)


def test_two_replicas_become_ready_roll_out_and_drain(deployment: Deployment) -> None:
    d = deployment
    assert d.replicas == 2
    old = [d.start_pod() for _ in range(d.replicas)]
    eventually(lambda: d.all_ready(2), "2/2 ready, one leader")  # the follower is ready too
    assert all(answers(p.endpoint, d.live_service) for p in old)
    (leader,) = d.leaders()
    (follower,) = [p for p in old if p is not leader]
    assert (leader_metric(leader), leader_metric(follower)) == (1, 0)  # the leader indicator, for Prometheus

    # The Service may send a client to the follower: it redirects, and the client gets its turn.
    gpu = rota.connect(group="g", tenant="t1", endpoint=follower.endpoint)
    try:
        assert gpu.acquire().token >= 1
        gpu.release()
    finally:
        gpu.close()

    # A drain may evict one replica now (the PDB allows it) ...
    assert d.disruptions_allowed() >= 1

    # ... and a rollout finishes: with maxUnavailable 0 each surge pod must become ready before an
    # old one goes; a new pod starts as a follower. The leader goes first, the hardest case.
    assert (d.max_unavailable, d.surge) == (0, 1)
    for going in (leader, follower):
        d.start_pod()
        eventually(lambda: len(d.ready()) == d.replicas + d.surge, "the surge pod ready as a follower")
        d.delete_pod(going)
        eventually(lambda: d.all_ready(d.replicas), f"{d.replicas}/{d.replicas} ready, one leader, after a step")
    assert not set(d.pods) & set(old)

    # Drain the node of the new leader: the other replica takes over and the group still works.
    (leader,) = d.leaders()
    d.delete_pod(leader)
    eventually(lambda: d.all_ready(1), "the remaining replica ready and leading")
    gpu = rota.connect(group="g", tenant="t2", endpoint=d.pods[0].endpoint)
    try:
        assert gpu.acquire().token >= 1
        gpu.release()
    finally:
        gpu.close()


def leader_metric(pod: Any) -> float:
    with urllib.request.urlopen(pod.metrics_url, timeout=10) as resp:
        families = {f.name: f for f in text_string_to_metric_families(resp.read().decode())}
    return families["rota_orchestrator_leader"].samples[0].value


def test_a_replica_without_etcd_is_live_but_not_ready(deployment: Deployment, tmp_path) -> None:
    """Readiness means 'answers calls': a replica that cannot know a leader (its etcd is gone) leaves the
    Service; liveness ("" SERVING) keeps it from being restarted for a cluster-wide outage."""
    d = deployment
    pods = [d.start_pod() for _ in range(2)]
    eventually(lambda: d.all_ready(2), "2/2 ready")
    with etcd_testing.EtcdCluster(tmp_path / "etcd-lonely", size=1) as lonely:
        stray = etcd_testing.OrchestratorProcess(lonely.url, tmp_path / "stray.log", args=["--ttl", "3"],
                                                 env=d.env).start()
        try:
            eventually(lambda: answers(stray.endpoint, LEADER_HEALTH), "the stray replica leading its own etcd")
            for member in lonely.members:
                member.kill()
            eventually(lambda: not answers(stray.endpoint, d.ready_service), "the replica without etcd not ready")
            assert answers(stray.endpoint, d.live_service)
        finally:
            stray.stop()
    assert len(d.ready()) == len(pods)
