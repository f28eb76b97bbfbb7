"""``counts_cache``: a tenant keeps its CUDA cache between turns only while its own ``WorkingSet`` is registered,
because only then does its footprint (and so the orchestrator's capacity) count that cache. Tenants, their plugin
manager and the working sets are real; the allocator's peak is a stand-in (no GPU here), and the cache itself is
only on CUDA (``tests/cuda/test_torch_park_cuda.py`` checks it is kept there)."""

from __future__ import annotations

import rota
from rota.testing import running_orchestrator
from rota_torch import WorkingSet, counts_cache


def test_only_the_tenant_whose_working_set_is_registered_keeps_its_cache() -> None:
    with running_orchestrator() as (endpoint, _engine):
        a = rota.connect(group="cc", tenant="a", endpoint=endpoint)
        b = rota.connect(group="cc", tenant="b", endpoint=endpoint)
        try:
            assert not counts_cache(a) and not counts_cache(b)  # nothing counts their caches: trimmed as before
            working = WorkingSet(a, "cpu", peak=lambda: 0, reset=lambda: None)
            assert counts_cache(a)
            assert not counts_cache(b)  # another tenant's working set, on the same process's manager or not
            a.pm.unregister(working)
            assert not counts_cache(a)  # gone with its working set
        finally:
            a.close()
            b.close()
