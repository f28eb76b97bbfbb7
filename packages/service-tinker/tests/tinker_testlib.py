"""Helpers shared by rota-service-tinker's tests (a named module: other packages have conftest modules too)."""

from __future__ import annotations

import contextlib
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tinker import types

from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator
from rota_tinker import BaseModelSpec, ServiceConfig, Tenant, TinkerService, find_models, search_dirs
from rota_tinker.testing import full_training_client  # noqa: F401 (the tests import it from here)

# keys of 128 random bits and more, the same in every process of a test (the service refuses guessable ones)
KEYS = {name: "tml-" + hashlib.sha256(f"rota-test-key:{name}".encode()).hexdigest()[:43]
        for name in ("alice", "bob", "carol", "dave")}
# A base big enough (about 80 MB) that a private copy of it per worker would stand out of a process's memory.
WIDE = BaseModelSpec("rota/wide", vocab=16384, dim=512, layers=1, heads=4, seed=3)


def batch(step: int, seed: int, vocab: int = 128, n: int = 2, length: int = 12) -> list[types.Datum]:
    """A deterministic batch of next-token data for ``step``."""
    rng = np.random.default_rng([seed, step])
    out = []
    for _ in range(n):
        toks = rng.integers(0, vocab, size=length + 1)
        out.append(types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
            loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(toks[1:].astype(np.int64)),
                            "weights": types.TensorData.from_numpy(np.ones(length, dtype=np.float32))}))
    return out



def concurrently(calls: dict[str, Callable[[], Any]], timeout_s: float = 600) -> dict[str, Any]:
    """Run each call in its own thread at once; their results by key (the first error is raised)."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []

    def run(key: str, fn: Callable[[], Any]) -> None:
        try:
            results[key] = fn()
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=item) for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"still running after {timeout_s} s"
    return results


@contextlib.contextmanager
def serving_hf_models(model_dirs: list[str], data_dir: str, group: str, **config: Any) -> Iterator[TinkerService]:
    """The service for every tenant of KEYS, serving the Hugging Face models found in ``model_dirs`` (by hub name),
    on a fresh orchestrator; ``config``: more ServiceConfig fields."""
    searched = search_dirs(model_dirs)
    with running_orchestrator(OrchestratorConfig(ttl_s=10.0, park_timeout_s=60.0)) as (endpoint, _engine):
        cfg = ServiceConfig(tenants=tuple(Tenant(n, k) for n, k in KEYS.items()), data_dir=data_dir, endpoint=endpoint,
                            group=group, long_poll_s=2.0, base_models=find_models(searched),
                            model_dirs=tuple(searched), **config)
        with TinkerService(cfg) as svc:
            yield svc


@contextlib.contextmanager
def serving_tiny_qwen(root: Path, group: str, seed: int) -> Iterator[TinkerService]:
    """The service for every tenant of KEYS on a tiny Qwen3 (random weights from ``seed``, a local tokenizer) in a
    plain folder ``root/models/acme/Qwen3-Tiny``, served as ``acme/Qwen3-Tiny``."""
    from rota_tinker.testing import hf_snapshot

    hf_snapshot(root / "models" / "acme" / "Qwen3-Tiny", seed=seed)
    with serving_hf_models([str(root / "models")], str(root / "data"), group) as svc:
        yield svc


def await_queued(service: TinkerService, tenant: str, kinds: list[str], since: int, timeout_s: float = 120) -> None:
    """Wait until units of ``kinds`` (with repeats; newer than future number ``since``) of ``tenant`` reached its
    workers' pipes."""
    for _ in range(int(timeout_s / 0.05)):  # a hang guard, not a threshold: normally a few rounds
        with service.state.lock:
            futures = list(service.state.futures.values())[since:]
        if Counter(kinds) <= Counter(f.kind for f in futures if f.tenant == tenant and "submitted" in f.timing):
            return
        time.sleep(0.05)
    raise AssertionError(f"{kinds} of {tenant} never reached its workers")



def held_back(service: TinkerService, group: str, kind: str, submit: Callable[[], dict[str, Any]],
              timeout_s: float = 180) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Submit requests (``submit()`` gives each tenant's SDK future) while another rota tenant holds the device, let
    go once all reached their workers, wait for them: (each tenant's result, the unit timings of ``kind`` they
    made)."""
    import rota

    blocker = rota.connect(group=group, tenant="blocker", endpoint=service.config.endpoint)
    try:
        blocker.acquire()
        with service.state.lock:
            since = len(service.state.futures)
        futures = submit()
        for tenant in futures:
            await_queued(service, tenant, [kind], since, timeout_s)
        time.sleep(0.5)  # the units reach the worker's pipe (no threshold: fewer together only weakens a check)
        blocker.release()
        results = {t: f.result(timeout=timeout_s) for t, f in futures.items()}
    finally:
        blocker.close()
    with service.state.lock:
        ours = {f.request_id for f in list(service.state.futures.values())[since:]}
    return results, [u for u in service.unit_timings() if u["request_id"] in ours and u["kind"] == kind]
