"""A worker whose tenant's last park left too much on the device takes no turn until that is resolved: it frees
what it can and measures again (Gpu.recheck_park); while the residue stays, the unit fails naming it.

The tenant is a real rota.Gpu on a real orchestrator; what it parks is rota.testing's ListState leaving a named
1 GiB behind until told to free it (on CUDA that is what a cache a model keeps would do)."""

from __future__ import annotations

import pytest

import rota
from rota.residue import ResidueError
from rota.testing import ListState, quick_config, running_orchestrator
from rota_tinker._worker.loop import ParkFault, resolve_failed_park


def test_a_failed_park_keeps_the_tenant_off_the_device_until_it_is_freed() -> None:
    with running_orchestrator(quick_config()) as (endpoint, _engine):
        gpu = rota.connect(group="g", tenant="alice.trainer", endpoint=endpoint)
        leaky = ListState(gpu, leaves=1 << 30)
        try:
            resolve_failed_park(gpu)  # nothing parked yet: nothing to resolve
            with pytest.raises(ResidueError):
                gpu.park()
            with pytest.raises(ParkFault, match=r"takes no turn .*untracked:state\.cache 1024\.0 MiB"):
                resolve_failed_park(gpu)
            assert gpu.grant is None  # it did not acquire
            leaky.leaves = 0  # what stayed is gone now
            resolve_failed_park(gpu)
            gpu.acquire()  # and it takes turns again
            gpu.release()
        finally:
            leaky.close()
            gpu.close()
