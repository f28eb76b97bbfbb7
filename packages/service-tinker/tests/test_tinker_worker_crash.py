"""A worker crash fails that tenant's futures with an error; other tenants keep working."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest
import tinker
from tinker import types
from tinker_testlib import batch

from rota_tinker import TinkerService


def step(tc: object) -> float:
    fb = tc.forward_backward(batch(0, seed=9), "cross_entropy")  # type: ignore[attr-defined]
    op = tc.optim_step(types.AdamParams(learning_rate=1e-2))  # type: ignore[attr-defined]
    loss = fb.result(timeout=120).metrics["loss:sum"]
    op.result(timeout=120)
    return loss


def test_killed_trainer_fails_its_futures_others_continue(service: TinkerService,
                                                          client: Callable[[str], tinker.ServiceClient]) -> None:
    carol = client("carol").create_lora_training_client(base_model="rota/tiny", rank=2, seed=1).result(timeout=120)
    dave = client("dave").create_lora_training_client(base_model="rota/tiny", rank=2, seed=1).result(timeout=120)
    first = step(carol), step(dave)
    assert first[0] == first[1]  # same seeds, same data: same numbers

    pid = service.worker_pid("carol", "trainer")
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait for the process to be gone (bounded)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)

    with pytest.raises(tinker.RequestFailedError, match=r"carol\.trainer worker exited"):
        carol.forward_backward(batch(0, seed=9), "cross_entropy").result(timeout=120)

    assert step(dave) < first[1]  # dave's model is intact and keeps training

    # carol starts over: a new model gets a fresh worker, and the same numbers as before the crash
    again = client("carol").create_lora_training_client(base_model="rota/tiny", rank=2, seed=1).result(timeout=120)
    assert service.worker_pid("carol", "trainer") != pid
    assert step(again) == first[0]
