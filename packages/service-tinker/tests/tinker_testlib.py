"""Helpers shared by rota-service-tinker's tests (a named module: other packages have conftest modules too)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
from tinker import types

from rota_tinker import BaseModelSpec
from rota_tinker.testing import full_training_client  # noqa: F401 (the tests import it from here)

KEYS = {name: f"tml-{name}-test-key-0123" for name in ("alice", "bob", "carol", "dave")}
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
