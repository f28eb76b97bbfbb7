"""Issue 45 row 14: stability records (``record_stability_info``) at the per-tenant bound.

The attacker, with its own key, sampled with ``record_stability_info=True`` until it held its budget of
recorded tokens in one-token sequences: ~1.25 GiB of the service's memory per key (the budget counted tokens,
not what each record costs), and each further record held the lock that every tenant's ``stable_reinforce``
and sample results need for 1.3-1.6 s (the eviction scanned every tenant's records).

Driven here on the service's own record store (``rota_tinker._http.stability``, the object the HTTP process
keeps; the real server cannot be filled with millions of samples in a CPU test): the bytes the attacker's
records hold, measured with tracemalloc, and the work one more record costs, counted as the lines the store
runs (deterministic, unlike a clock), at two sizes of the attacker's holding.
"""

from __future__ import annotations

import gc
import sys
import tracemalloc

import numpy as np

from rota_tinker._http.stability import StabilityRecords

PER_REQUEST = 64  # sequences per sample request (num_samples)


def _sample(store: StabilityRecords, tenant: str, request: int) -> None:
    """One sample request of one-token sequences, recorded as the service records it."""
    ids = [f"req-{tenant}-{request:08d}-0123456789abcdef:{i}" for i in range(PER_REQUEST)]
    store.record(tenant, f"session-{tenant}", ids, np.array([7]), [([1], [-0.5])] * PER_REQUEST)


def _fill(store: StabilityRecords, tenant: str, requests: int) -> None:
    for r in range(requests):
        _sample(store, tenant, r)


def _lines_run(fn) -> int:
    """Lines of the record store that ``fn()`` runs."""
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        if frame.f_code.co_filename.endswith("stability.py"):
            if event == "line":
                count += 1
            return tracer
        return None

    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return count


def test_a_tenant_at_its_record_bound_holds_about_twelve_bytes_per_budget_token():
    budget = 40_000
    gc.collect()
    tracemalloc.start()
    try:
        store = StabilityRecords(max_tokens=budget)
        before = tracemalloc.get_traced_memory()[0]
        _fill(store, "mallory", 400)  # far past its bound
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert store.count("mallory") > 0
    assert held <= 16 * budget, f"{held} bytes for a budget of {budget} tokens ({store.count('mallory')} records)"


def test_one_more_record_costs_the_same_however_many_the_tenant_holds():
    small, large = StabilityRecords(max_tokens=40_000), StabilityRecords(max_tokens=160_000)
    _fill(small, "mallory", 400)
    _fill(large, "mallory", 1600)  # both at their bounds: the large one holds four times the records
    assert large.count("mallory") >= 3 * small.count("mallory")
    for store in (small, large):
        _sample(store, "victim", 0)
    costs = [_lines_run(lambda s=s: _sample(s, "mallory", 10**6)) for s in (small, large)]
    assert costs[1] <= costs[0] * 1.2, f"lines run for one more record: {costs} (holding 1x and 4x the records)"
    victim = [_lines_run(lambda s=s: s.end_session("session-victim")) for s in (small, large)]
    assert victim[1] <= victim[0] * 1.2, f"lines run to end the victim's session: {victim}"
    assert small.count("victim") == 0 and large.count("mallory") > 0
