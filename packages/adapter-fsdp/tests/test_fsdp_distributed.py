"""2-rank jobs on gloo (FSDP2 and DDP), parked and restored every step, stay bit-identical."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from rota.testing import free_port

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_two_ranks_parked_every_step_are_bit_identical(endpoint, tmp_path, mode):
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    logs = [open(tmp_path / f"rank{r}.log", "w") for r in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, mode, str(r), "2", port, endpoint, str(outs[r])],
                              env=env, stdout=logs[r], stderr=subprocess.STDOUT) for r in range(2)]
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in logs:
            f.close()
    for r, p in enumerate(procs):
        assert p.returncode == 0, (tmp_path / f"rank{r}.log").read_text()[-3000:]
    for r in range(2):
        res = torch.load(outs[r], weights_only=True)
        assert res["sharded"] is (mode == "fsdp2")
        assert all(res["freed"])
        assert res["allocations"] == 1
        assert len(res["losses"]) == len(res["ref_losses"]) == 20
        for got, want in zip(res["losses"], res["ref_losses"], strict=True):
            assert torch.equal(got, want)
        assert res["state"].keys() == res["ref_state"].keys()
        for k in res["ref_state"]:
            assert torch.equal(res["state"][k], res["ref_state"][k]), k
        if mode == "fsdp2":  # grads of one reduce-scatter share a storage: fewer storages than tensors
            assert res["storages"] < res["tensors"]
