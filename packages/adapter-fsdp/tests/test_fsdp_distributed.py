"""2-rank jobs on gloo (FSDP2 and DDP), parked and restored every step, stay bit-identical."""

from __future__ import annotations

import os

import pytest
import torch

from rota.testing import free_port, run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fsdp_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["fsdp2", "ddp"])
def test_two_ranks_parked_every_step_are_bit_identical(endpoint, tmp_path, mode):
    port = str(free_port())
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    run_ranks(WORKER, lambda r: [mode, str(r), "2", port, endpoint, str(outs[r])], world=2, logdir=tmp_path,
              timeout=240)
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
            assert res["kept_freed"] == {"torch 2.11 attribute": True, "torch 2.12 list": True}
