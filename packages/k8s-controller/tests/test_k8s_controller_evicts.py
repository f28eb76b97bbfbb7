"""The controller releases dead pods' turns: FakeKubeApi + a REAL orchestrator over gRPC.

The Kubernetes side is FakeKubeApi (rota_k8s_controller.testing), a SMALL FAKE serving only
the pod list/watch endpoints that the official ``kubernetes`` client calls, because no
real API server can run here. The orchestrator side is real: rota's orchestrator
serving rota.v1 on loopback, tenants acquiring over gRPC, the controller sending
Evict. Each test drives pod create/delete/evict/node-lost sequences and checks who
holds the group afterwards.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from rota.testing import eventually
from rota_k8s_controller.controller import Controller, grpc_evictor
from rota_k8s_controller.names import GROUP_LABEL, JOB_LABEL
from rota_k8s_controller.testing import FakeKubeApi

G = "grp0"
NS = "default"  # FakeKubeApi's pods' namespace: rota knows their jobs as default.<label>
RG = f"{NS}.{G}"


def labels(job: str, group: str = G) -> dict[str, str]:
    return {JOB_LABEL: job, GROUP_LABEL: group}


def rid(job: str) -> str:
    """rota's id of the job labelled ``job`` in namespace default."""
    return f"{NS}.{job}"


@pytest.fixture
def controller(core_api: Any, orchestrator: tuple[str, Any]) -> Iterator[Controller]:
    ctl = Controller(core_api, grpc_evictor(orchestrator[0]), watch_timeout=2, retry_delay=0.1)
    thread = threading.Thread(target=ctl.run, name="rota-k8s-controller", daemon=True)
    thread.start()
    yield ctl
    ctl.stop()
    thread.join(15)
    assert not thread.is_alive(), "controller did not stop"


def holder(engine: Any, group: str = RG) -> str:
    g = engine.groups.get(group)
    return g.holder if g else ""


def queue(engine: Any, group: str = RG) -> list[str]:
    g = engine.groups.get(group)
    return [w.job_id for w in g.queue] if g else []


def hold_and_wait(tenants: Any, engine: Any, fake_api: FakeKubeApi) -> tuple[Any, Any]:
    """a holds the group, b waits; both have running pods."""
    fake_api.create_pod("a-0", labels=labels("a"))
    fake_api.create_pod("b-0", labels=labels("b"))
    a = tenants(rid("a"), RG).acquire_in_background()
    assert a.granted.wait(30), a.error
    b = tenants(rid("b"), RG).acquire_in_background()
    eventually(lambda: queue(engine) == [rid("b")], "b to queue behind a")
    return a, b


def test_deleted_holder_pod_releases_its_turn_to_the_next_waiter(
        fake_api: FakeKubeApi, orchestrator: tuple[str, Any], tenants: Any, controller: Controller) -> None:
    _, engine = orchestrator
    _a, b = hold_and_wait(tenants, engine, fake_api)
    eventually(lambda: fake_api.watch_count() >= 1, "the controller to watch")
    assert holder(engine) == rid("a") and not b.granted.is_set()

    fake_api.delete_pod("a-0")

    assert b.granted.wait(30), f"b was not granted after a's pod was deleted: {b.error}"
    assert holder(engine) == rid("b")
    # the grant may reach b before the controller has recorded the answer to its Evict
    eventually(lambda: controller.evicted, "the controller to record the eviction")
    assert [(e.group_id, e.job_id) for e in controller.evicted] == [(RG, rid("a"))]
    assert "deleted" in controller.evicted[0].reason


def test_waiter_pod_deleted_leaves_the_queue_and_holder_keeps_the_group(
        fake_api: FakeKubeApi, orchestrator: tuple[str, Any], tenants: Any, controller: Controller) -> None:
    _, engine = orchestrator
    _, b = hold_and_wait(tenants, engine, fake_api)

    fake_api.delete_pod("b-0")

    eventually(lambda: queue(engine) == [], "b to leave the queue")
    assert holder(engine) == rid("a")
    eventually(lambda: b.error is not None, "b's Acquire to fail")


def test_kubelet_eviction_and_node_loss_release_turns(
        fake_api: FakeKubeApi, orchestrator: tuple[str, Any], tenants: Any, controller: Controller) -> None:
    _, engine = orchestrator
    _a, b = hold_and_wait(tenants, engine, fake_api)
    fake_api.create_pod("c-0", labels=labels("c"), node="gpu-node-2")
    c = tenants(rid("c"), RG).acquire_in_background()
    eventually(lambda: queue(engine) == [rid("b"), rid("c")], "c to queue behind b")

    def evicted(pod: dict[str, Any]) -> None:
        pod["status"] = {"phase": "Failed", "reason": "Evicted", "message": "The node was low on memory."}

    fake_api.update_pod("a-0", evicted)
    assert b.granted.wait(30), b.error
    assert holder(engine) == rid("b")

    # b's node stops answering; the taint manager marks its pod for deletion, which
    # kubelet can never confirm: the controller must not wait for DELETED.
    def node_lost(pod: dict[str, Any]) -> None:
        pod["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
        pod["status"]["conditions"] = [{"type": "DisruptionTarget", "status": "True",
                                        "reason": "DeletionByTaintManager",
                                        "message": "Taint manager: deleting due to NoExecute taint"}]

    fake_api.update_pod("b-0", node_lost)
    assert c.granted.wait(30), c.error
    assert holder(engine) == rid("c")
    eventually(lambda: {rid("a"), rid("b")} <= {e.job_id for e in controller.evicted},
             "the controller to record both evictions")
    reasons = {e.job_id: e.reason for e in controller.evicted}
    assert "Evicted" in reasons[rid("a")] and "node is lost" in reasons[rid("b")]


def test_graceful_termination_keeps_the_turn_until_the_pod_is_gone(
        fake_api: FakeKubeApi, orchestrator: tuple[str, Any], tenants: Any, controller: Controller) -> None:
    _, engine = orchestrator
    _, b = hold_and_wait(tenants, engine, fake_api)

    def terminating(pod: dict[str, Any]) -> None:
        pod["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"

    fake_api.update_pod("a-0", terminating)
    # A later event proves the controller has processed the terminating one.
    fake_api.create_pod("other", labels={"unrelated": "x"})
    fake_api.create_pod("z-0", labels=labels("z", "grp-other"))
    eventually(lambda: controller.tracker.alive(NS, "grp-other", "z"), "the controller to see later events")
    assert holder(engine) == rid("a") and controller.evicted == []

    fake_api.delete_pod("a-0")
    assert b.granted.wait(30), b.error


def test_job_with_two_rank_pods_is_evicted_only_when_both_are_gone(
        fake_api: FakeKubeApi, orchestrator: tuple[str, Any], tenants: Any, controller: Controller) -> None:
    _, engine = orchestrator
    _, b = hold_and_wait(tenants, engine, fake_api)
    fake_api.create_pod("a-1", labels=labels("a"))
    eventually(lambda: sum(1 for p in controller.tracker.pods.values() if p.key == (NS, G, "a")) == 2,
             "the controller to see both ranks of a")

    fake_api.delete_pod("a-0")
    fake_api.create_pod("z-0", labels=labels("z", "grp-other"))
    eventually(lambda: controller.tracker.alive(NS, "grp-other", "z"), "the controller to see later events")
    assert holder(engine) == rid("a") and not b.granted.is_set()

    fake_api.delete_pod("a-1")
    assert b.granted.wait(30), b.error


def test_pod_deleted_during_a_watch_gap_is_evicted_after_relisting(
        fake_api: FakeKubeApi, orchestrator: tuple[str, Any], tenants: Any, controller: Controller) -> None:
    _, engine = orchestrator
    _, b = hold_and_wait(tenants, engine, fake_api)
    eventually(lambda: controller.tracker.alive(NS, G, "a"), "the controller to see a")
    lists_before = sum(1 for _, q in fake_api.requests if "watch" not in q)

    # The pod vanishes and the history is compacted: the running watch ends and the
    # next one from the old resourceVersion gets 410 Gone, so only a relist can tell.
    with fake_api.cond:
        fake_api.pods.pop(("default", "a-0"))
    fake_api.compact()

    assert b.granted.wait(30), b.error
    assert holder(engine) == rid("b")
    assert sum(1 for _, q in fake_api.requests if "watch" not in q) > lists_before
    eventually(lambda: controller.evicted, "the controller to record the eviction")
    assert "watch was down" in controller.evicted[0].reason


def test_eviction_is_retried_while_the_orchestrator_is_unreachable(
        fake_api: FakeKubeApi, core_api: Any, orchestrator: tuple[str, Any], tenants: Any) -> None:
    """First Evict calls hit a dead address; the controller keeps the eviction and retries."""
    from rota.errors import Unavailable

    endpoint, engine = orchestrator
    real = grpc_evictor(endpoint)
    calls: list[str] = []

    def flaky(e: Any) -> None:
        calls.append(e.job_id)
        if len(calls) < 3:
            raise Unavailable("orchestrator unreachable (injected)", job_id=e.job_id, group_id=e.group_id)
        real(e)

    ctl = Controller(core_api, flaky, watch_timeout=1, retry_delay=0.1)
    thread = threading.Thread(target=ctl.run, daemon=True)
    thread.start()
    try:
        _, b = hold_and_wait(tenants, engine, fake_api)
        eventually(lambda: ctl.tracker.alive(NS, G, "a"), "the controller to see a")
        fake_api.delete_pod("a-0")
        assert b.granted.wait(30), b.error
        eventually(lambda: ctl.pending == {}, "the controller to clear the done eviction")
        assert calls[:3] == [rid("a")] * 3
    finally:
        ctl.stop()
        thread.join(15)


def test_controller_survives_api_errors(
        fake_api: FakeKubeApi, orchestrator: tuple[str, Any], tenants: Any, core_api: Any) -> None:
    _, engine = orchestrator
    fake_api.fail_next_lists = 2
    ctl = Controller(core_api, grpc_evictor(orchestrator[0]), watch_timeout=1, retry_delay=0.1)
    thread = threading.Thread(target=ctl.run, daemon=True)
    thread.start()
    try:
        _, b = hold_and_wait(tenants, engine, fake_api)
        eventually(lambda: ctl.tracker.alive(NS, G, "a"), "the controller to list after two 500s")
        fake_api.delete_pod("a-0")
        assert b.granted.wait(30), b.error
    finally:
        ctl.stop()
        thread.join(15)
