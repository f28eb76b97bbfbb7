"""The tenant-pod controller: no group stays held, or queued for, by a dead pod.

``rota k8s controller`` runs beside the orchestrator (a second container of its
Deployment). It lists and watches pods carrying ``timeslice.io/group`` through the
official ``kubernetes`` client and, when the last live pod of a job is gone, calls
``rota.v1.RotaService/Evict`` on the orchestrator: the job's turn is released if it
held one and it leaves the queue, so the next waiter is granted.

When a pod counts as dead (:func:`dead_reason`):

* it was deleted (DELETED event: kubelet confirmed its containers stopped, or it was
  force-deleted);
* its phase is Failed or Succeeded (kubelet eviction sets Failed/Evicted);
* its node is lost: phase Unknown, reason NodeLost, or the taint manager deleting it
  (condition DisruptionTarget/DeletionByTaintManager) — kubelet can never confirm
  those, so waiting for DELETED could hold the group forever.

A pod that is merely terminating gracefully is still alive: its process may still
be using the GPU, and releasing its turn early would let two tenants run at once.
A job with several pods (ranks) is evicted when none of them is alive; losing one
rank is left to the orchestrator's session TTL.

Eviction is idempotent (a second Evict of the same job answers was_holder=False), so
every orchestrator replica may run a controller. Evictions that fail because the
orchestrator is unreachable are retried until they succeed or the job comes back.
After a watch gap (410 Gone, broken connection) the controller lists again and
treats jobs that vanished meanwhile as deleted.

Environment: the client configuration comes from the in-cluster service account,
else ``KUBECONFIG`` / ``~/.kube/config``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import grpc

from rota._generated import rota_v1_pb2 as pb
from rota._generated import rota_v1_pb2_grpc as pb_grpc
from rota.errors import PermanentError, RotaError, from_rpc_error
from rota_k8s.manifests import GROUP_LABEL, JOB_LABEL

__all__ = ["Controller", "Eviction", "PodTracker", "dead_reason", "grpc_evictor"]

log = logging.getLogger(__name__)
Pod = dict[str, Any]
JobKey = tuple[str, str]  # (group_id, job_id)


@dataclass(frozen=True)
class Eviction:
    """A job whose last live pod is gone, and why."""

    group_id: str
    job_id: str
    reason: str


def dead_reason(pod: Pod) -> str | None:
    """Why this pod (an API object as a dict) no longer runs its tenant, or None if it may."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    name = f"{meta.get('namespace', '')}/{meta.get('name', '?')}"
    phase = status.get("phase")
    reason = status.get("reason") or ""
    if phase in ("Failed", "Succeeded"):
        detail = f" ({reason}: {status.get('message', '')})" if reason else ""
        return f"pod {name} {phase.lower()}{detail}"
    if phase == "Unknown" or reason == "NodeLost":
        return f"pod {name} lost its node {pod.get('spec', {}).get('nodeName', '')}".rstrip()
    if meta.get("deletionTimestamp"):
        for cond in status.get("conditions") or []:
            if cond.get("type") == "DisruptionTarget" and cond.get("reason") == "DeletionByTaintManager":
                return f"pod {name} deleted because its node is lost ({cond.get('message', '')})"
    return None


@dataclass
class _PodInfo:
    key: JobKey
    alive: bool
    why: str = ""


@dataclass
class PodTracker:
    """What the controller knows about tenant pods; decides which jobs to evict.

    Pure state: fed with watch events (``observe``) or a full list (``resync``), it
    returns the evictions those imply. Pods without both labels are ignored.
    """

    pods: dict[str, _PodInfo] = field(default_factory=dict)

    @staticmethod
    def _identity(pod: Pod) -> str:
        meta = pod.get("metadata") or {}
        return meta.get("uid") or f"{meta.get('namespace', '')}/{meta.get('name', '')}"

    @staticmethod
    def _job(pod: Pod) -> JobKey | None:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        group, job = labels.get(GROUP_LABEL), labels.get(JOB_LABEL)
        return (group, job) if group and job else None

    def _alive(self, key: JobKey) -> bool:
        return any(p.alive and p.key == key for p in self.pods.values())

    def _known(self, key: JobKey) -> bool:
        return any(p.key == key for p in self.pods.values())

    def observe(self, event_type: str, pod: Pod) -> list[Eviction]:
        """Apply one watch event (ADDED, MODIFIED, DELETED); return evictions it causes."""
        key = self._job(pod)
        if key is None:
            return []
        ident = self._identity(pod)
        was_alive = self._alive(key)
        if event_type == "DELETED":
            name = f"{pod.get('metadata', {}).get('namespace', '')}/{pod.get('metadata', {}).get('name', '?')}"
            why = dead_reason(pod) or f"pod {name} deleted"
            self.pods.pop(ident, None)
        else:
            why = dead_reason(pod) or ""
            self.pods[ident] = _PodInfo(key, alive=not why, why=why)
        if was_alive and not self._alive(key):
            return [Eviction(key[0], key[1], why)]
        return []

    def resync(self, pods: Iterable[Pod]) -> list[Eviction]:
        """Replace the state with a fresh list; evict jobs that died or vanished since."""
        before = {p.key for p in self.pods.values() if p.alive}
        fresh: dict[str, _PodInfo] = {}
        for pod in pods:
            key = self._job(pod)
            if key is None:
                continue
            why = dead_reason(pod) or ""
            fresh[self._identity(pod)] = _PodInfo(key, alive=not why, why=why)
        self.pods = fresh
        out = []
        for key in sorted(before | {p.key for p in fresh.values()}):
            if self._alive(key):
                continue
            whys = [p.why for p in fresh.values() if p.key == key and p.why]
            if key in before or whys:
                out.append(Eviction(key[0], key[1], whys[0] if whys else "pod gone while the watch was down"))
        return out

    def alive(self, group_id: str, job_id: str) -> bool:
        """True while some live pod carries this job."""
        return self._alive((group_id, job_id))


Evictor = Callable[[Eviction], None]


def grpc_evictor(endpoint: str, *, timeout: float = 10.0) -> Evictor:
    """An evictor calling ``rota.v1.RotaService/Evict`` at ``endpoint``; raises RotaError on failure."""
    channel = grpc.insecure_channel(endpoint)
    stub = pb_grpc.RotaServiceStub(channel)

    def evict(e: Eviction) -> None:
        try:
            reply = stub.Evict(pb.EvictRequest(job_id=e.job_id, group_id=e.group_id, reason=e.reason),
                               timeout=timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, job_id=e.job_id, group_id=e.group_id) from None
        log.info("evicted job %s from group %s (was holder: %s, was queued: %s): %s", e.job_id, e.group_id,
                 reply.was_holder, reply.was_queued, e.reason)

    return evict


class Controller:
    """Lists and watches tenant pods and evicts dead jobs through ``evict``.

    :param core_api: a ``kubernetes.client.CoreV1Api``.
    :param evict: called for each eviction; raising a transient RotaError retries it later.
    :param namespace: watch one namespace; empty = all namespaces.
    :param watch_timeout: seconds the API server keeps one watch open before we re-watch.
    :param retry_delay: seconds between retries after API or orchestrator errors.
    """

    def __init__(self, core_api: Any, evict: Evictor, *, namespace: str = "", watch_timeout: int = 60,
                 retry_delay: float = 2.0) -> None:
        self.api = core_api
        self.evict = evict
        self.namespace = namespace
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        self.tracker = PodTracker()
        self.pending: dict[JobKey, Eviction] = {}
        self.stopped = threading.Event()
        self.evicted: list[Eviction] = []  # what was sent, for status and tests
        self._watch: Any = None

    # ---------------------------------------------------------------- API calls

    def _list_func(self) -> Callable[..., Any]:
        if self.namespace:
            return lambda **kw: self.api.list_namespaced_pod(self.namespace, **kw)
        return self.api.list_pod_for_all_namespaces

    def _list(self) -> tuple[list[Pod], str]:
        import json

        resp = self._list_func()(label_selector=GROUP_LABEL, _preload_content=False,
                                 _request_timeout=self.watch_timeout + 10)
        body = json.loads(resp.data)
        return body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion", "")

    # -------------------------------------------------------------- the loop

    def _handle(self, evictions: list[Eviction]) -> None:
        for e in evictions:
            self.pending[(e.group_id, e.job_id)] = e
        self._flush()

    def _flush(self) -> None:
        for key, e in list(self.pending.items()):
            if self.tracker.alive(*key):  # the job came back (a new pod): nothing to evict
                del self.pending[key]
                continue
            try:
                self.evict(e)
            except PermanentError as exc:
                log.warning("evicting job %s from group %s failed for good: %s", e.job_id, e.group_id, exc)
            except RotaError as exc:
                log.warning("evicting job %s from group %s failed, will retry: %s", e.job_id, e.group_id, exc)
                continue
            self.evicted.append(e)
            del self.pending[key]

    def run_once(self) -> None:
        """One list followed by one watch until the server ends it (or stop())."""
        from kubernetes import watch

        items, rv = self._list()
        self._handle(self.tracker.resync(items))
        self._watch = watch.Watch()
        for event in self._watch.stream(self._list_func(), label_selector=GROUP_LABEL, resource_version=rv,
                                        timeout_seconds=self.watch_timeout, allow_watch_bookmarks=True,
                                        deserialize=False, _request_timeout=self.watch_timeout + 10):
            if self.stopped.is_set():
                break
            kind, obj = event.get("type"), event.get("object") or {}
            if kind in ("ADDED", "MODIFIED", "DELETED"):
                self._handle(self.tracker.observe(kind, obj))
            elif self.pending:
                self._flush()
        if self.pending:
            self._flush()

    def run(self) -> None:
        """Run until :meth:`stop`; API errors and watch gaps lead to a fresh list after a pause."""
        from kubernetes.client.exceptions import ApiException

        while not self.stopped.is_set():
            try:
                self.run_once()
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch expired (410 Gone): listing again")
                    continue
                log.warning("Kubernetes API error %s: %s; listing again in %.0fs", exc.status, exc.reason,
                            self.retry_delay)
                self.stopped.wait(self.retry_delay)
            except Exception as exc:  # connection errors of urllib3 etc.: keep the controller alive
                if self.stopped.is_set():
                    break
                log.warning("watching pods failed (%s: %s); listing again in %.0fs", type(exc).__name__, exc,
                            self.retry_delay)
                self.stopped.wait(self.retry_delay)

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current watch event or timeout."""
        self.stopped.set()
        if self._watch is not None:
            self._watch.stop()


def api_client_from_environment(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """An ApiClient for the in-cluster service account, or for a kubeconfig (given, $KUBECONFIG, ~/.kube/config).

    A given ``kubeconfig`` or ``context`` skips the in-cluster configuration.
    """
    from kubernetes import client, config

    if not (kubeconfig or context):
        cfg = client.Configuration()
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except config.ConfigException:
            pass
    return config.new_client_from_config(config_file=kubeconfig, context=context)


def core_api_from_environment(kubeconfig: str | None = None, context: str | None = None) -> Any:
    """A CoreV1Api configured in-cluster (service account) or from a kubeconfig."""
    from kubernetes import client

    return client.CoreV1Api(api_client_from_environment(kubeconfig, context))
