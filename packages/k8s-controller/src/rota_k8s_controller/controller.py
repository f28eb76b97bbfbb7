"""The tenant-pod controller: each job gets its token, and no group stays held by a dead pod.

``rota k8s controller`` runs beside the orchestrator (a second container of its
Deployment). It lists and watches pods carrying ``timeslice.io/group`` in the tenant
namespaces (``--namespace``, repeatable; all namespaces without it) through the official
``kubernetes`` client.

A job is (namespace, group label, job label): rota knows it as
``<namespace>.<group>`` / ``<namespace>.<job>`` (:func:`rota_k8s_controller.names.rota_ids`), so
a pod in another team's namespace that copies a job's labels is another job.

Tokens (with ``--auth-key``): when a job's first live pod appears, the controller issues
a token for exactly that job (``rota.auth.issue``) into the Secret
``rota-token-<job>`` of the pod's namespace (key ``token``), which the tenant pod reads
as ROTA_TOKEN. The Secret is owned by the pod's Job (or the pod), so Kubernetes collects
it if the controller does not; the controller deletes it when the job is gone. It never
reads a Secret: RBAC gives it create, update and delete only.

Which pods count as dead is :func:`dead_reason`'s rule (README, 'The controller'): a
pod that is merely terminating gracefully is still alive, since its process may still
be using the GPU. A job with several pods (ranks) is evicted when none of them is
alive; losing one rank is left to the orchestrator's session TTL. Evict is
idempotent, so every orchestrator replica may run a controller; evictions and Secret
writes that fail for a reason that may pass are retried, and after a watch gap (410
Gone, broken connection) the controller lists again and treats jobs that vanished
meanwhile as deleted.

Environment: the client configuration comes from the in-cluster service account,
else ``KUBECONFIG`` / ``~/.kube/config``.
"""

from __future__ import annotations

import base64
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rota import admin, auth
from rota.errors import PermanentError, RotaError, TransientError
from rota_k8s_controller.names import (
    GROUP_LABEL,
    JOB_LABEL,
    PART_OF,
    TOKEN_KEY,
    dns_label_ok,
    label_value_problem,
    rota_ids,
    token_secret_name,
)

__all__ = ["Controller", "Eviction", "JobKey", "PodTracker", "TokenSecrets", "api_client_from_environment",
           "core_api_from_environment", "dead_reason", "grpc_evictor", "job_key"]

log = logging.getLogger(__name__)
Pod = dict[str, Any]
JobKey = tuple[str, str, str]  # (namespace, group label, job label)
ADMIN_TOKEN_TTL_S = 300.0  # the controller's own Evict credential, made afresh for each call


@dataclass(frozen=True)
class Eviction:
    """A job whose last live pod is gone, and why (rota's ids: ``<namespace>.<label>``)."""

    group_id: str
    job_id: str
    reason: str

    @property
    def key(self) -> JobKey:
        """(namespace, group label, job label): namespaces hold no dot, so the ids split back exactly."""
        ns, _, group = self.group_id.partition(".")
        return ns, group, self.job_id.partition(".")[2]


def _eviction(key: JobKey, reason: str) -> Eviction:
    return Eviction(*rota_ids(*key), reason)


def dead_reason(pod: Pod) -> str | None:
    """Why this pod (an API object as a dict) no longer runs its tenant, or None if it may.

    Dead: phase Failed or Succeeded (kubelet eviction sets Failed/Evicted), or its node
    lost (phase Unknown, reason NodeLost, or deletion by the taint manager), which the
    kubelet can never confirm. A DELETED watch event is dead too (:class:`PodTracker`).
    """
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


def job_key(pod: Pod) -> JobKey | None:
    """The job a pod belongs to, or None when it lacks a label or a namespace (then it is no tenant)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    ns, group, job = meta.get("namespace") or "", labels.get(GROUP_LABEL) or "", labels.get(JOB_LABEL) or ""
    if not (isinstance(ns, str) and dns_label_ok(ns)):
        return None
    if label_value_problem("group", group) or label_value_problem("job", job):
        return None
    return ns, group, job


@dataclass
class _PodInfo:
    key: JobKey
    alive: bool
    why: str = ""
    owner: dict[str, Any] = field(default_factory=dict)  # what owns the job's token Secret
    priority: int = 0  # the ROTA_PRIORITY its containers ask for (0 when none, or none above 0)


def _priority(pod: Pod) -> int:
    """The highest ROTA_PRIORITY a container of ``pod`` sets (``rota k8s`` tenants do), 0 if none is above 0."""
    best = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        for env in c.get("env") or []:
            value = str(env.get("value") or "").strip() if env.get("name") == "ROTA_PRIORITY" else ""
            if value.isdigit() and len(value) <= 6:
                best = max(best, int(value))
    return best


def _owner(pod: Pod) -> dict[str, Any]:
    """The pod's controlling owner (its Job), else the pod itself: the owner reference of its job's Secret."""
    meta = pod.get("metadata") or {}
    for ref in meta.get("ownerReferences") or []:
        if ref.get("controller") and ref.get("uid") and ref.get("name") and ref.get("kind"):
            return {"apiVersion": ref.get("apiVersion", ""), "kind": ref["kind"], "name": ref["name"],
                    "uid": ref["uid"]}
    if meta.get("uid") and meta.get("name"):
        return {"apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"]}
    return {}


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

    def _alive(self, key: JobKey) -> bool:
        return any(p.alive and p.key == key for p in self.pods.values())

    def observe(self, event_type: str, pod: Pod) -> list[Eviction]:
        """Apply one watch event (ADDED, MODIFIED, DELETED); return evictions it causes."""
        key = job_key(pod)
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
            self.pods[ident] = _PodInfo(key, alive=not why, why=why, owner=_owner(pod), priority=_priority(pod))
        if was_alive and not self._alive(key):
            return [_eviction(key, why)]
        return []

    def resync(self, pods: Iterable[Pod], namespace: str = "") -> list[Eviction]:
        """Replace what is known of ``namespace`` (all: "") with a fresh list; evict jobs that died or vanished."""
        def mine(info: _PodInfo) -> bool:
            return not namespace or info.key[0] == namespace

        before = {p.key for p in self.pods.values() if p.alive and mine(p)}
        fresh: dict[str, _PodInfo] = {i: p for i, p in self.pods.items() if not mine(p)}
        for pod in pods:
            key = job_key(pod)
            if key is None:
                continue
            why = dead_reason(pod) or ""
            fresh[self._identity(pod)] = _PodInfo(key, alive=not why, why=why, owner=_owner(pod),
                                                  priority=_priority(pod))
        self.pods = fresh
        out = []
        for key in sorted(before | {p.key for p in fresh.values() if mine(p)}):
            if self._alive(key):
                continue
            whys = [p.why for p in fresh.values() if p.key == key and p.why]
            if key in before or whys:
                out.append(_eviction(key, whys[0] if whys else "pod gone while the watch was down"))
        return out

    def alive(self, namespace: str, group: str, job: str) -> bool:
        """True while some live pod carries this job."""
        return self._alive((namespace, group, job))

    def live_jobs(self) -> dict[JobKey, dict[str, Any]]:
        """Every job with a live pod, and the owner its token Secret gets."""
        return {p.key: p.owner for p in self.pods.values() if p.alive}

    def priority(self, key: JobKey) -> int:
        """The highest priority the live pods of job ``key`` ask for (ROTA_PRIORITY; 0 when none above 0)."""
        return max((p.priority for p in self.pods.values() if p.alive and p.key == key), default=0)


Evictor = Callable[[Eviction], None]


def grpc_evictor(endpoint: str, *, key: bytes | None = None, timeout: float = 10.0) -> Evictor:
    """An evictor calling ``rota.v1.RotaService/Evict`` at ``endpoint`` (:func:`rota.admin.evict`, one attempt:
    the controller retries a transient failure later); raises RotaError on failure. A group the orchestrator
    does not have means the job is already gone: logged, not raised.

    With ``key`` every call carries a fresh admin token made with it (the orchestrator's
    ``--auth-key``); TLS comes from ROTA_TLS_* (:func:`rota.auth.channel`).
    """
    def evict(e: Eviction) -> None:
        token = auth.issue(key, admin=True, ttl_s=ADMIN_TOKEN_TTL_S) if key else ""
        result = admin.evict(endpoint, e.job_id, e.group_id, reason=e.reason, timeout=timeout, retry=False,
                             token=token)
        if result.gone:
            log.info("job %s was already gone: the orchestrator has no group %s (%s)", e.job_id, e.group_id,
                     e.reason)
            return
        log.info("evicted job %s from group %s (was holder: %s, was queued: %s): %s", e.job_id, e.group_id,
                 result.was_holder, result.was_queued, e.reason)

    return evict


class SecretWriteError(TransientError):
    """The API server did not take a token Secret write; trying again may work."""


class SecretRefused(PermanentError):
    """The API server refused a token Secret write for good (forbidden, invalid)."""


class TokenSecrets:
    """Writes each job's token into ``rota-token-<job>`` of its namespace, and deletes it when the job is gone.

    :param core_api: a ``kubernetes.client.CoreV1Api``.
    :param key: the auth key (the orchestrator's ``--auth-key``).
    :param ttl_s: lifetime of the tokens; a pod reads ROTA_TOKEN when it starts, so this
        must outlast the job.
    :param max_priority: the highest priority a job's token may allow (``--max-priority``):
        its pods' ROTA_PRIORITY up to this; the orchestrator refuses more than the token's.
    """

    def __init__(self, core_api: Any, key: bytes, *, ttl_s: float = 30 * 86400.0, max_priority: int = 0) -> None:
        self.api, self.key, self.ttl_s, self.max_priority = core_api, key, ttl_s, max_priority

    def body(self, key: JobKey, owner: dict[str, Any], priority: int = 0) -> dict[str, Any]:
        """The Secret of job ``key``: its token for exactly (namespace.group, namespace.job), allowing the
        ``priority`` its pods ask for up to ``max_priority``."""
        ns, group, job = key
        group_id, job_id = rota_ids(ns, group, job)
        allowed = min(priority, self.max_priority)
        if priority > allowed:
            log.warning("job %s asks for priority %d; its token allows %d (rota k8s controller --max-priority)",
                        job_id, priority, allowed)
        token = auth.issue(self.key, group=group_id, job=job_id, ttl_s=self.ttl_s,
                           max_priority=allowed if allowed > 0 else None)
        meta: dict[str, Any] = {
            "name": token_secret_name(job), "namespace": ns,
            "labels": {"app.kubernetes.io/part-of": PART_OF, "app.kubernetes.io/managed-by": "rota-k8s",
                       "app.kubernetes.io/component": "token", GROUP_LABEL: group, JOB_LABEL: job}}
        if owner:
            meta["ownerReferences"] = [owner]
        return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
                "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()}}

    def put(self, key: JobKey, owner: dict[str, Any], priority: int = 0) -> None:
        """Create the job's Secret, or replace one left from before (another replica's, or a restart's)."""
        from kubernetes.client.exceptions import ApiException

        body = self.body(key, owner, priority)
        name, ns = body["metadata"]["name"], key[0]
        try:
            try:
                self.api.create_namespaced_secret(ns, body, _preload_content=False, _request_timeout=30)
            except ApiException as exc:
                if exc.status != 409:
                    raise
                self.api.replace_namespaced_secret(name, ns, body, _preload_content=False, _request_timeout=30)
        except ApiException as exc:
            raise self._error(exc, f"cannot write Secret {ns}/{name}") from None
        except Exception as exc:  # connection refused, timeouts: urllib3 raises several kinds
            raise SecretWriteError(f"cannot write Secret {ns}/{name}: {type(exc).__name__}: {exc}") from None
        log.info("issued the token of job %s into Secret %s/%s", rota_ids(*key)[1], ns, name)

    def delete(self, key: JobKey) -> None:
        """Delete the job's Secret (gone already is fine)."""
        from kubernetes.client.exceptions import ApiException

        name, ns = token_secret_name(key[2]), key[0]
        try:
            self.api.delete_namespaced_secret(name, ns, _preload_content=False, _request_timeout=30)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise self._error(exc, f"cannot delete Secret {ns}/{name}") from None
        except Exception as exc:
            raise SecretWriteError(f"cannot delete Secret {ns}/{name}: {type(exc).__name__}: {exc}") from None

    @staticmethod
    def _error(exc: Any, what: str) -> RotaError:
        text = f"{what}: HTTP {exc.status} {exc.reason}"
        if exc.status in (400, 401, 403, 404, 422):
            hint = " (is the namespace one of the controller's --namespace, with its Role?)" if exc.status == 403 \
                else ""
            return SecretRefused(text + hint)
        return SecretWriteError(text)


class Controller:
    """Lists and watches tenant pods, issues each job's token, and evicts dead jobs through ``evict``.

    :param core_api: a ``kubernetes.client.CoreV1Api``.
    :param evict: called for each eviction; raising a transient RotaError retries it later.
    :param namespaces: watch these namespaces (one watch each); empty = all namespaces.
    :param tokens: where to issue job tokens; None = issue none.
    :param watch_timeout: seconds the API server keeps one watch open before we re-watch.
    :param retry_delay: seconds between retries after API or orchestrator errors.
    """

    def __init__(self, core_api: Any, evict: Evictor, *, namespaces: Sequence[str] = (),
                 tokens: TokenSecrets | None = None, watch_timeout: int = 60, retry_delay: float = 2.0) -> None:
        self.api = core_api
        self.evict = evict
        self.namespaces = tuple(namespaces)
        self.tokens = tokens
        self.watch_timeout = watch_timeout
        self.retry_delay = retry_delay
        self.tracker = PodTracker()
        self.pending: dict[JobKey, Eviction] = {}
        self.issued: set[JobKey] = set()  # jobs whose Secret this controller wrote
        self.to_delete: set[JobKey] = set()  # Secrets of gone jobs
        self.stopped = threading.Event()
        self.evicted: list[Eviction] = []  # what was sent, for status and tests
        self._lock = threading.RLock()
        self._watches: list[Any] = []
        self._in_touch: dict[str, float] = {}  # namespace ("" = all) -> monotonic time of its last list or event

    def out_of_touch_s(self) -> float:
        """Seconds since the least recently heard-from watched namespace had a list, a watch event or a renewal;
        infinite before every watched namespace's first list. The health probe's measure."""
        now = time.monotonic()
        return max((now - self._in_touch.get(ns, -math.inf) for ns in (self.namespaces or ("",))), default=0.0)

    # ---------------------------------------------------------------- API calls

    def _list_func(self, namespace: str) -> Callable[..., Any]:
        if namespace:
            return lambda **kw: self.api.list_namespaced_pod(namespace, **kw)
        return self.api.list_pod_for_all_namespaces

    def _list(self, namespace: str) -> tuple[list[Pod], str]:
        resp = self._list_func(namespace)(label_selector=GROUP_LABEL, _preload_content=False,
                                          _request_timeout=self.watch_timeout + 10)
        body = json.loads(resp.data)
        return body.get("items") or [], (body.get("metadata") or {}).get("resourceVersion", "")

    # -------------------------------------------------------------- the loop

    def _handle(self, evictions: list[Eviction]) -> None:
        with self._lock:
            for e in evictions:
                self.pending[e.key] = e
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
            self.issued.discard(key)
            self.to_delete.add(key)
        if self.tokens is not None:
            self._flush_tokens(self.tokens)

    def _flush_tokens(self, tokens: TokenSecrets) -> None:
        live = self.tracker.live_jobs()
        for key in sorted(self.to_delete):
            if key in live:  # back before its Secret went: it is issued again below
                self.to_delete.discard(key)
                continue
            try:
                tokens.delete(key)
            except PermanentError as exc:
                log.warning("%s; leaving it to Kubernetes' garbage collector", exc)
            except RotaError as exc:
                log.warning("%s; will retry", exc)
                continue
            self.to_delete.discard(key)
        for key, owner in sorted(live.items()):
            if key in self.issued:
                continue
            try:
                tokens.put(key, owner, self.tracker.priority(key))
            except PermanentError as exc:
                log.warning("%s; job %s gets no token", exc, rota_ids(*key)[1])
            except RotaError as exc:
                log.warning("%s; will retry", exc)
                continue
            self.issued.add(key)

    def _observe(self, kind: str, pod: Pod) -> None:
        with self._lock:
            self._handle(self.tracker.observe(kind, pod))

    def _resync(self, pods: list[Pod], namespace: str) -> None:
        with self._lock:
            self._handle(self.tracker.resync(pods, namespace))

    def run_once(self, namespace: str = "") -> None:
        """One list of ``namespace`` ("" = all) followed by one watch until the server ends it (or stop())."""
        from kubernetes import watch

        items, rv = self._list(namespace)
        self._resync(items, namespace)
        self._in_touch[namespace] = time.monotonic()
        w = watch.Watch()
        with self._lock:
            self._watches.append(w)
        try:
            for event in w.stream(self._list_func(namespace), label_selector=GROUP_LABEL, resource_version=rv,
                                  timeout_seconds=self.watch_timeout, allow_watch_bookmarks=True,
                                  deserialize=False, _request_timeout=self.watch_timeout + 10):
                if self.stopped.is_set():
                    break
                self._in_touch[namespace] = time.monotonic()
                kind, obj = event.get("type"), event.get("object") or {}
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    self._observe(kind, obj)
                else:
                    self._handle([])
            self._in_touch[namespace] = time.monotonic()  # the server ended the watch on time
            self._handle([])
        finally:
            with self._lock:
                self._watches.remove(w)

    def _run_namespace(self, namespace: str) -> None:
        from kubernetes.client.exceptions import ApiException

        where = namespace or "all namespaces"
        while not self.stopped.is_set():
            try:
                self.run_once(namespace)
            except ApiException as exc:
                if exc.status == 410:
                    log.info("watch of %s expired (410 Gone): listing again", where)
                    continue
                log.warning("Kubernetes API error %s watching %s: %s; listing again in %.0fs", exc.status, where,
                            exc.reason, self.retry_delay)
                self.stopped.wait(self.retry_delay)
            except Exception as exc:  # connection errors of urllib3 etc.: keep the controller alive
                if self.stopped.is_set():
                    break
                log.warning("watching pods of %s failed (%s: %s); listing again in %.0fs", where,
                            type(exc).__name__, exc, self.retry_delay)
                self.stopped.wait(self.retry_delay)

    def run(self) -> None:
        """Run until :meth:`stop`: one list-and-watch loop per namespace; errors lead to a fresh list."""
        if len(self.namespaces) <= 1:
            self._run_namespace(self.namespaces[0] if self.namespaces else "")
            return
        threads = [threading.Thread(target=self._run_namespace, args=(ns,), name=f"rota-k8s-watch-{ns}",
                                    daemon=True) for ns in self.namespaces]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def stop(self) -> None:
        """Ask :meth:`run` to return after the current watch event or timeout."""
        self.stopped.set()
        with self._lock:
            for w in self._watches:
                w.stop()


def api_client_from_environment(kubeconfig: str | None = None, context: str | None = None, *,
                                retries: int | None = None) -> Any:
    """An ApiClient for the in-cluster service account, or for a kubeconfig (given, $KUBECONFIG, ~/.kube/config).

    A given ``kubeconfig`` or ``context`` skips the in-cluster configuration. ``retries``:
    urllib3's retries per request (its default, 3, makes a silent API server cost four
    request timeouts; a command line gives 0 and one timeout).
    """
    from kubernetes import client, config

    cfg = client.Configuration()
    if retries is not None:
        cfg.retries = retries
    if not (kubeconfig or context):
        try:
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        except config.ConfigException:
            pass
    config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=cfg)
    return client.ApiClient(cfg)


def core_api_from_environment(kubeconfig: str | None = None, context: str | None = None, *,
                              retries: int | None = None) -> Any:
    """A CoreV1Api configured in-cluster (service account) or from a kubeconfig."""
    from kubernetes import client

    return client.CoreV1Api(api_client_from_environment(kubeconfig, context, retries=retries))
