"""When a pod counts as dead, and which jobs the tracker evicts (no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from rota_k8s_controller.controller import Eviction, PodTracker, dead_reason
from rota_k8s_controller.names import GROUP_LABEL, JOB_LABEL


def pod(name: str, job: str = "a", group: str = "g", *, uid: str = "", phase: str = "Running",
        **status: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": uid or name,
                         "labels": {JOB_LABEL: job, GROUP_LABEL: group}},
            "spec": {"nodeName": "n1"}, "status": {"phase": phase, **status}}


@pytest.mark.parametrize(("p", "words"), [
    (pod("x", phase="Failed", reason="Evicted", message="low on memory"), "failed (Evicted: low on memory)"),
    (pod("x", phase="Succeeded"), "succeeded"),
    (pod("x", phase="Unknown"), "lost its node n1"),
    (pod("x", reason="NodeLost"), "lost its node"),
])
def test_dead_pods(p: dict[str, Any], words: str) -> None:
    assert words in (dead_reason(p) or "")


def test_running_pending_and_gracefully_terminating_pods_are_alive() -> None:
    assert dead_reason(pod("x")) is None
    assert dead_reason(pod("x", phase="Pending")) is None
    terminating = pod("x")
    terminating["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    assert dead_reason(terminating) is None
    tainted = pod("x", conditions=[{"type": "DisruptionTarget", "reason": "DeletionByTaintManager"}])
    assert dead_reason(tainted) is None  # not being deleted (yet)
    tainted["metadata"]["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    assert "node is lost" in (dead_reason(tainted) or "")


def test_tracker_evicts_once_when_the_last_pod_of_a_job_dies() -> None:
    t = PodTracker()
    assert t.observe("ADDED", pod("a-0", uid="1")) == []
    assert t.observe("ADDED", pod("a-1", uid="2")) == []
    assert t.observe("DELETED", pod("a-0", uid="1")) == []
    (e,) = t.observe("MODIFIED", pod("a-1", uid="2", phase="Failed"))
    assert (e.group_id, e.job_id) == ("ns.g", "ns.a") and "failed" in e.reason and e.key == ("ns", "g", "a")
    assert t.observe("DELETED", pod("a-1", uid="2", phase="Failed")) == []  # already dead: no second eviction


def test_tracker_ignores_unlabelled_pods_and_keeps_groups_apart() -> None:
    t = PodTracker()
    stray = pod("s")
    del stray["metadata"]["labels"][JOB_LABEL]
    assert t.observe("ADDED", stray) == [] and t.pods == {}
    t.observe("ADDED", pod("a-0", group="g1"))
    t.observe("ADDED", pod("a-1", group="g2", uid="x"))
    assert t.observe("DELETED", pod("a-0", group="g1")) == [Eviction("ns.g1", "ns.a", "pod ns/a-0 deleted")]
    assert t.alive("ns", "g2", "a")


def test_resync_evicts_vanished_and_dead_jobs_only() -> None:
    t = PodTracker()
    t.resync([pod("a-0", "a"), pod("b-0", "b"), pod("c-0", "c")])
    out = t.resync([pod("b-0", "b", phase="Failed"), pod("c-0", "c"), pod("d-0", "d", phase="Succeeded")])
    assert [(e.job_id, e.reason.split(" ")[0]) for e in out] == [("ns.a", "pod"), ("ns.b", "pod"), ("ns.d", "pod")]
    assert "watch was down" in out[0].reason and "failed" in out[1].reason and "succeeded" in out[2].reason
    assert t.alive("ns", "g", "c") and not t.alive("ns", "g", "a")
