"""Code that frees a tracked model's tensors between turns while the orchestrator parks it.

``rota demo --device cuda`` failed parks this way: each worker freed its state at the end of its run while a
park the orchestrator had asked for was copying it (``The size of tensor a (22806528) must match the size of
tensor b (0)``), and the run reported nothing. Here the park is made to wait inside its copies (as a first
park waits for its host pool to be pinned) while the main thread frees the tensors: without
``gpu.hold_state()`` the park fails naming the tensor, keeps the state resident and is counted; with it, the
park waits for the free and moves nothing.
"""

from __future__ import annotations

import threading

import torch

import rota
import rota_fsdp
from rota_torch import HostPool, StateChanged


def _tenant(endpoint: str, name: str) -> tuple[rota.Gpu, torch.nn.Module, object]:
    gpu = rota.connect(group=f"race-{name}", tenant=name, endpoint=endpoint)
    model = torch.nn.Linear(256, 256)
    tracked = rota_fsdp.track(gpu, model, pool_bytes=0)
    return gpu, model, tracked


def _stall_copies(pool: HostPool) -> tuple[threading.Event, threading.Event]:
    """The pool's next wait for pinned bytes signals ``entered`` and waits for ``go``."""
    entered, go = threading.Event(), threading.Event()

    def wait_for(nbytes: int, check=None) -> bool:
        entered.set()
        assert go.wait(30)
        return HostPool.wait_for(pool, nbytes, check)

    pool.wait_for = wait_for  # type: ignore[method-assign]
    return entered, go


def _free(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.untyped_storage().resize_(0)


def test_freeing_tracked_tensors_during_a_park_fails_it_by_name_and_counts_it(endpoint: str) -> None:
    gpu, model, tracked = _tenant(endpoint, "race-free")
    try:
        entered, go = _stall_copies(tracked.parker.pool)
        errors: list[BaseException] = []
        parking = threading.Thread(target=lambda: _run(gpu.park, errors))
        parking.start()
        assert entered.wait(30)  # the park collected the storages and is about to copy them
        _free(model)  # what the demo's workers did at the end of their run
        go.set()
        parking.join(30)
        assert len(errors) == 1 and isinstance(errors[0], StateChanged), errors
        assert "'weight' (tag 'weights') went from 262144 to 0 bytes" in str(errors[0])
        assert "gpu.hold_state()" in str(errors[0])  # the fix is named
        assert not gpu.parked and gpu.park_failed  # nothing was freed by the park: the state counts as resident
        assert gpu.stats.failed("park") == 1 and gpu.stats.failures[-1][0] == "park"
    finally:
        gpu.close()
        tracked.untrack()


def test_hold_state_makes_the_park_wait_for_the_free(endpoint: str) -> None:
    gpu, model, tracked = _tenant(endpoint, "race-held")
    try:
        errors: list[BaseException] = []
        results: list[object] = []
        with gpu.hold_state():
            parking = threading.Thread(target=lambda: results.append(_run(gpu.park, errors)))
            parking.start()
            parking.join(0.5)
            assert parking.is_alive()  # the park waits for the block to end
            _free(model)
        parking.join(30)
        assert not errors and gpu.stats.failed("park") == 0
        assert results[0].bytes_moved == 0  # nothing was left to copy
    finally:
        gpu.close()
        tracked.untrack()


def test_hold_state_is_refused_inside_a_turn(endpoint: str) -> None:
    gpu, _model, tracked = _tenant(endpoint, "race-turn")
    try:
        with gpu.turn():
            try:
                with gpu.hold_state():
                    raise AssertionError("hold_state() ran inside a turn")
            except rota.errors.InvalidArgument as exc:
                assert "between turns" in str(exc)
    finally:
        gpu.close()
        tracked.untrack()


def _run(fn, errors: list[BaseException]):
    try:
        return fn()
    except BaseException as exc:  # collected for the test's thread
        errors.append(exc)
        return None
