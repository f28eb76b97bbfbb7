"""A tenant process for test_fsdp_guarantees.py: leaks a tensor, hangs a park, or has its host copy corrupted.

Usage: guard_worker.py MODE ENDPOINT DIR   (MODE: leak | hang | corrupt)
Writes DIR/ready after its first turn, waits for DIR/go (the test's tenant ran),
then takes another turn and writes DIR/result.json.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from fsdp_testlib import make_model, make_optimizer, train_step

import rota
import rota_fsdp
from rota.errors import RotaError


def wait_for(path: str, timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.02)


def main() -> None:
    mode, endpoint, out = sys.argv[1:4]
    torch.set_num_threads(1)
    gpu = rota.connect(group="g", tenant=f"{mode}-job", endpoint=endpoint)
    model = make_model(0)
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt, deadline_s=0.3 if mode == "hang" else None)
    if mode == "leak":
        model[0].cache = torch.ones(1 << 20)  # 4 MiB on the device that nobody told rota about
    hang = [False]
    if mode == "hang":  # a weights source that hangs once armed: the park step runs past its deadline
        tracked.parker.add("weights", lambda: (time.sleep(1.5) if hang[0] else None, [])[1])
    result: dict[str, object] = {}
    with gpu.turn():
        train_step(model, opt, 0)
    if mode == "corrupt":
        gpu.park()
        for chunk in tracked.parker.pool.chunks:
            chunk.zero_()
        try:
            gpu.acquire()
            result["acquired"] = True
        except RotaError as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["parked_after_refusal"] = gpu.parked and tracked.parked
        result["weights_freed"] = all(p.untyped_storage().nbytes() == 0 for p in model.parameters())
        tracked.parker.verify = "off"
    hang[0] = True
    open(os.path.join(out, "ready"), "w").close()
    wait_for(os.path.join(out, "go"))
    hang[0] = False
    result["parked"] = gpu.parked
    result["residue"] = gpu.last_park.residue
    result["weights_resident"] = all(p.untyped_storage().nbytes() > 0 for p in model.parameters())
    if mode != "corrupt":
        with gpu.turn():  # FAULTED is retryable: the next acquire takes a turn again
            result["loss"] = float(train_step(model, opt, 1))
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f)
    tracked.untrack()
    gpu.close()


if __name__ == "__main__":
    main()
