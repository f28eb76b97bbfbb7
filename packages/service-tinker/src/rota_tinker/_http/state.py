"""The HTTP process's state: sessions, models, weights, sampling sessions, futures and the workers that hold
them, with the quotas and what frees them (the routes are :mod:`.service`, :mod:`.training`, :mod:`.sampling`)."""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rota_tinker._config import BaseModelSpec, ServiceConfig
from rota_tinker._http import checkpoints as _checkpoints
from rota_tinker._http import usage as _usage
from rota_tinker._http.budget import Budget
from rota_tinker._http.formats import QuotaExceeded
from rota_tinker._http.handles import Future, WorkerHandle
from rota_tinker._http.server import Reply
from rota_tinker._http.stability import StabilityRecords
from rota_tinker._worker.common import WorkerSpec

log = logging.getLogger("rota_tinker._http.service")

PROTO = "application/x-protobuf"
_NAME = _checkpoints.NAME  # checkpoint names: they become file names
_ID = _checkpoints.ID
_PATH = re.compile(rf"tinker://({_ID})/sampler_weights/({_ID})")
SEED_BOUNDS = (0, 2**63 - 1)
# a model's newest ephemeral sampler weights kept; older ones are deleted (an RL loop saves one every step)
EPHEMERAL_KEEP = 4
BATCH_UNITS_PER_TURN = 4096  # the batched LoRA worker runs every unit queued when its turn starts (a bound)

# The flags this server answers /client/config with: API keys only (no JWT exchange),
# the plain httpx transport, uncompressed protobuf forward_backward bodies.
# The SDK's byte estimate of a datum (tinker TrainingClient): 4 per input token plus its loss inputs,
# of which target_tokens (int64, one per token) is always there.
SDK_BYTES_PER_TOKEN = 4 + 8
CLIENT_CONFIG = {
    "pjwt_auth_enabled": False,
    "credential_default_source": "api_key",
    "use_pyqwest_transport": False,
    "proto_compress_fwdbwd": False,
    "parallel_fwdbwd_chunks": False,
    "sample_use_retrieve_futures": False,
    "sample_join_sampling_session": False,
    "custom_loss_server_side": False,
}


def _json(obj: Any, status: int = 200) -> Reply:
    return Reply.json(obj, status)


@dataclass
class _Session:
    session_id: str
    tenant: str
    last_seen: float  # monotonic: created, or its last heartbeat
    user_metadata: dict[str, str] | None = None
    display_name: str | None = None
    project_id: str | None = None  # rota_tinker._http.projects
    created: float = field(default_factory=time.time)


@dataclass
class _Model:
    model_id: str
    tenant: str
    base: BaseModelSpec
    lora: dict[str, Any] | None
    session_id: str
    bytes: int  # estimated state: weights, grads, Adam moments (and a private base)
    ephemeral: list[str] = field(default_factory=list)  # tinker paths of its ephemeral weights, oldest first


@dataclass
class _Weights:
    path: str
    tenant: str
    base: BaseModelSpec
    file: str  # its folder (rota_tinker._worker.state_files): the sampler's key, the archive's content
    lora: bool  # adapter weights (they go on the shared base), or a full model
    bytes: int  # its files' size
    ephemeral: bool = False  # saved for a sampling client only (not listed as a checkpoint)
    created: float = field(default_factory=time.time)
    user_metadata: dict[str, str] | None = None
    expires: float | None = None  # wall clock (ttl_seconds, set_checkpoint_ttl); None: never
    public: bool = False


@dataclass
class _SamplingSession:
    session_id: str
    tenant: str
    base: BaseModelSpec
    key: str  # weights folder, or "base:NAME"
    model_path: str | None
    shareable: bool  # adapter weights or the bare base: sampled on the shared base
    parent: str  # the training session it was made in (it ends with it)


class _State:
    """Everything the service knows; guarded by one lock (requests are short)."""

    def __init__(self, config: ServiceConfig, endpoint: str | None) -> None:
        self.config = config
        self.lock = threading.Lock()
        self.sessions: dict[str, _Session] = {}
        # sessions that ended (heartbeats then get 410), the latest per tenant, so the SDK stops heart-beating
        self.finished: dict[str, OrderedDict[str, str]] = {t.name: OrderedDict() for t in config.tenants}
        self.models: dict[str, _Model] = {}
        self.creating: dict[str, _Model] = {}  # create_model accepted, the worker not done yet (counts for quotas)
        self.weights: dict[str, _Weights] = {}  # tinker:// path -> weights
        self.runs = _checkpoints.Runs()  # training runs and training checkpoints (save_state)
        self.usage_counts = _usage.Usage()  # tokens and checkpoints by the hour (get_billing_usage)
        self.sampling: dict[str, _SamplingSession] = {}
        self.stability = StabilityRecords()  # samples recorded for stable_reinforce (record_stability_info)
        self.futures: dict[str, Future] = {}
        self.future_session: dict[str, str] = {}  # request id -> its session (for session traces)
        self._last_prune = 0.0
        self._last_sweep = 0.0
        self.stopping = False  # stop() is saying farewell: heartbeats answer 410 (TinkerService.stop)
        self.farewelled: set[str] = set()  # sessions whose heartbeat got that answer
        self.forgotten_futures = 0  # finished futures dropped after future_ttl_s
        self.budget = Budget(config.max_queued_units, config.max_result_bytes, config.result_grace_s)
        self.workers: dict[tuple[str, str], WorkerHandle] = {}
        for t in config.tenants:
            for role in ("trainer", "sampler"):
                spec = WorkerSpec(tenant=t.name, role=role, group=config.group, endpoint=endpoint,
                                  device=config.device, data_dir=config.data_dir, torch_threads=config.torch_threads,
                                  units_per_turn=config.units_per_turn, release_cached=config.release_cached,
                                  deterministic=config.deterministic, lora_concurrency=config.lora_concurrency)
                self.workers[(t.name, role)] = WorkerHandle(spec, config.worker_start_timeout_s)
        self.holders: dict[str, WorkerHandle] = {}  # base name -> its holder on config.device
        self.batchers: dict[str, WorkerHandle] = {}  # base name -> its batched LoRA worker (config.lora_batch)
        self.endpoint = endpoint  # a holder with a shared LoRA turn takes turns there (rota_tinker._worker.shared_turn)

    def holder(self, base: BaseModelSpec) -> WorkerHandle:
        """The base-holder process of ``base`` on the service's device (made on first use, started by ``ensure``)."""
        return self._made_once(self.holders, base, lambda n: dict(
            tenant=f"{base.name}@{self.config.device}", role="base", base=base,
            lora_concurrency=self.config.lora_concurrency, shared_turn_job=f"lora-shared.{n}"))

    def _made_once(self, table: dict[str, WorkerHandle], base: BaseModelSpec,
                   fields: Callable[[int], dict[str, Any]]) -> WorkerHandle:
        """``table``'s worker for ``base``, its handle made on first use from ``fields(len(table))`` (a WorkerSpec's
        own fields; the service's group, endpoint, device, data directory and threads are added)."""
        with self.lock:
            handle = table.get(base.name)
            if handle is None:
                spec = WorkerSpec(group=self.config.group, endpoint=self.endpoint, device=self.config.device,
                                  data_dir=self.config.data_dir, torch_threads=self.config.torch_threads,
                                  **fields(len(table)))
                handle = table[base.name] = WorkerHandle(spec, self.config.worker_start_timeout_s)
        return handle

    def trainer_of(self, m: _Model) -> WorkerHandle:
        """The worker that holds model ``m``: with ``lora_batch`` a LoRA model is in its base's batched worker
        (rota_tinker._worker.batch, made on first use), anything else in its tenant's trainer."""
        if self.config.lora_batch and m.lora is not None:
            return self.batcher(m.base)
        return self.workers[(m.tenant, "trainer")]

    def sampler_of(self, tenant: str, base: BaseModelSpec, shareable: bool) -> WorkerHandle:
        """Where a sample runs: with ``lora_batch``, samples on the shared base (LoRA weights or the bare base) decode
        in its batched worker, many tenants' rows in one batch; others in the tenant's sampler."""
        if self.config.lora_batch and shareable:  # lora_batch needs share_lora_base (ServiceConfig checks)
            return self.batcher(base)
        return self.workers[(tenant, "sampler")]

    def batcher(self, base: BaseModelSpec) -> WorkerHandle:
        """The batched LoRA worker of ``base`` (made on first use, started by its first unit)."""
        return self._made_once(self.batchers, base, lambda n: dict(
            tenant=f"lora-batch.{n}", role="batch", units_per_turn=BATCH_UNITS_PER_TURN,
            deterministic=self.config.deterministic, lora_batch_tokens=self.config.lora_batch_tokens))

    def forget_weights(self, tenant: str, base: BaseModelSpec, key: str) -> None:
        """Let the workers that may hold weights ``key`` drop them: the tenant's sampler and the base's batched worker,
        each only if it runs (one that never started holds nothing)."""
        with self.lock:
            handles = [self.workers[(tenant, "sampler")], self.batchers.get(base.name)]
        for handle in handles:
            if handle is not None and handle.pid is not None:
                fut = self.future(tenant, "ForgetWeights")
                args = {"key": key, "owner": tenant} if handle.spec.role == "batch" else {"key": key}
                handle.submit(fut, "forget", args, lambda _r, fut=fut: fut.succeed(json={}))

    def shared_base(self, base: BaseModelSpec, shareable: bool) -> str | None:
        """The address workers fetch ``base`` from, or None (sharing is off, or a full model needs its own copy).

        :raises RuntimeError: the holder could not start (the caller fails its future with it).
        """
        if not (shareable and self.config.share_lora_base):
            return None
        return str(self.holder(base).ensure()["address"])

    @staticmethod
    def new_id(prefix: str) -> str:
        """``prefix`` and 128 random bits. No counter: ids were ``PREFIX-N-RANDOM`` with one ``N`` for the whole
        service, so two of one tenant's ids told it how many requests, sessions and models the others made between
        them (issue 45 row 11)."""
        return f"{prefix}-{secrets.token_hex(16)}"

    def future(self, tenant: str, kind: str, session: str | None = None, *, result_bytes: int | None = None) -> Future:
        """A new request's future; ``session``: the session it belongs to (its trace, rota_tinker._http.trace).

        ``result_bytes`` (a tenant's work unit: the most its result can take) counts it against the key's queued
        units and result bytes (rota_tinker._http.budget) until its result is let go; the service's own units
        (unloads at a session's end, forgetting weights) give none.

        :raises BadRequest: past a bound of the key (429) or a result too large for it (400).
        """
        fut = Future(request_id=self.new_id("req"), tenant=tenant, kind=kind)
        with self.lock:
            self._forget_old_futures()
            if result_bytes is not None:
                self.budget.admit(tenant, fut, result_bytes)
            self.futures[fut.request_id] = fut
            if session is not None:
                self.future_session[fut.request_id] = session
        if result_bytes is not None:
            fut.add_done_callback(lambda: self.budget.finished(fut))
        return fut

    def _forget_old_futures(self) -> None:
        """Drop futures finished more than ``future_ttl_s`` ago (at most one scan a second; lock held)."""
        now = time.monotonic()
        if now - self._last_prune < 1.0:
            return
        self._last_prune = now
        cutoff = now - self.config.future_ttl_s
        old = [rid for rid, f in self.futures.items() if f.finished_at is not None and f.finished_at < cutoff]
        for rid in old:
            self.budget.forget(self.futures.pop(rid))
            self.future_session.pop(rid, None)
            self.forgotten_futures += 1

    # ------------------------------------------------------------ quotas

    def usage(self, tenant: str) -> dict[str, int]:
        """What ``tenant`` holds now: live models (and those being created), sessions, bytes (lock held)."""
        models = [m for m in (*self.models.values(), *self.creating.values()) if m.tenant == tenant]
        sessions = sum(s.tenant == tenant for s in self.sessions.values())
        sessions += sum(s.tenant == tenant for s in self.sampling.values())
        nbytes = sum(m.bytes for m in models) + sum(w.bytes for w in self.weights.values() if w.tenant == tenant)
        nbytes += self.runs.bytes_of(tenant)
        return {"models": len(models), "sessions": sessions, "bytes": nbytes}

    def check_quota(self, tenant: str, *, models: int = 0, sessions: int = 0, nbytes: int = 0) -> None:
        """Raise QuotaExceeded (429) when adding this much would take ``tenant`` past a quota (lock held)."""
        have = self.usage(tenant)
        c = self.config
        if models and have["models"] + models > c.max_models:
            raise QuotaExceeded(f"tenant {tenant} already holds {have['models']} models, the most one key may "
                                f"hold (max_models={c.max_models}); unload one (POST /api/v1/unload_model) or "
                                "finish the session that made it (ServiceClient.close())")
        if sessions and have["sessions"] + sessions > c.max_sessions:
            raise QuotaExceeded(f"tenant {tenant} already has {have['sessions']} live sessions (training and "
                                f"sampling), the most one key may hold (max_sessions={c.max_sessions}); finish one "
                                "(ServiceClient.close()) or let idle ones expire")
        if nbytes and have["bytes"] + nbytes > c.max_bytes:
            raise QuotaExceeded(f"tenant {tenant} holds {have['bytes']} bytes of models and saved weights; {nbytes} "
                                f"more would pass max_bytes={c.max_bytes}; unload a model (POST "
                                "/api/v1/unload_model) or delete saved weights "
                                "(RestClient.delete_checkpoint_from_tinker_path)")

    # ------------------------------------------------------------ freeing

    def sweep(self) -> bool:
        """End sessions whose heartbeats stopped ``session_ttl_s`` ago (at most one scan a second: True when this
        call scanned)."""
        now = time.monotonic()
        with self.lock:
            if now - self._last_sweep < 1.0:
                return False
            self._last_sweep = now
            stale = [s.session_id for s in self.sessions.values() if now - s.last_seen > self.config.session_ttl_s]
        for sid in stale:
            self.end_session(sid, f"no heartbeat for {self.config.session_ttl_s:g} s")
        return True

    def end_session(self, sid: str, why: str) -> None:
        """End a session: its sampling sessions end and its models are unloaded (their quota freed at once)."""
        with self.lock:
            session = self.sessions.pop(sid, None)
            if session is None:
                return
            done = self.finished[session.tenant]
            done[sid] = session.tenant
            while len(done) > self.config.max_sessions:
                done.popitem(last=False)
            for ssid in [k for k, s in self.sampling.items() if s.parent == sid]:
                del self.sampling[ssid]
            models = [m for m in self.models.values() if m.session_id == sid]
        self.stability.end_session(sid)
        log.info("tenant %s: session %s ended (%s); unloading %d model(s)", session.tenant, sid, why, len(models))
        for m in models:
            self.unload(m, self.future(m.tenant, "UnloadModel"))

    def unload(self, m: _Model, fut: Future) -> None:
        """Forget model ``m`` and its ephemeral weights; its trainer drops it in its next turn."""
        with self.lock:
            self.models.pop(m.model_id, None)
        for path in list(m.ephemeral):
            self.delete_weights(path)
        self.trainer_of(m).submit(
            fut, "unload", {"model_id": m.model_id},
            lambda _result: fut.succeed(json={"model_id": m.model_id, "type": "unload_model"}))

    def delete_weights(self, path: str) -> None:
        """Delete saved sampler weights: their folder, the sampling sessions on them, the sampler's copy."""
        with self.lock:
            w = self.weights.pop(path, None)
            if w is None:
                return
            for ssid in [k for k, s in self.sampling.items() if s.model_path == path]:
                del self.sampling[ssid]
        shutil.rmtree(w.file, ignore_errors=True)
        self.forget_weights(w.tenant, w.base, w.file)


    def forget_checkpoint(self, tenant: str, path: str, folder: str, base: BaseModelSpec) -> None:
        """A training checkpoint deleted or expired: the sampling sessions on it end, the running workers that may
        hold its weights let them go (sampler weights go through delete_weights)."""
        with self.lock:
            for ssid in [k for k, s in self.sampling.items() if s.model_path == path]:
                del self.sampling[ssid]
        self.forget_weights(tenant, base, folder)


def _start_quietly(handle: WorkerHandle) -> None:
    """Start a worker ahead of its first unit; a failure is kept by the handle and fails that unit instead."""
    with contextlib.suppress(RuntimeError):
        handle.ensure()


