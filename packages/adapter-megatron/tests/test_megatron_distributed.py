"""2-rank Megatron-Core GPT jobs on gloo, parked and restored every step, stay bit-identical."""

from __future__ import annotations

import os

import pytest
import torch

from rota.testing import free_port, run_ranks

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "megatron_worker.py")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["plain", "distopt", "distopt-bf16"])
def test_two_ranks_parked_every_step_are_bit_identical(endpoint, tmp_path, mode):
    port = str(free_port())
    outs = [tmp_path / f"rank{r}.pt" for r in range(2)]
    run_ranks(WORKER, lambda r: [mode, str(r), "2", port, endpoint, str(outs[r])], world=2, logdir=tmp_path,
              timeout=300, env={"CUDA_VISIBLE_DEVICES": ""})
    results = [torch.load(o, weights_only=True) for o in outs]
    for res in results:
        assert all(res["freed"]), res["freed"]
        assert res["allocations"] == 1  # the pool estimate covered weights, grads and optimizer state
        assert len(res["losses"]) == len(res["ref_losses"]) == 6
        for got, want in zip(res["losses"], res["ref_losses"], strict=True):
            assert torch.equal(got, want)
        assert res["state"].keys() == res["ref_state"].keys()
        for k in res["ref_state"]:
            assert torch.equal(res["state"][k], res["ref_state"][k]), k
        assert all(res["by_tag"][tag] > 0 for tag in ("weights", "grads", "optimizer")), res["by_tag"]
        if mode != "plain":  # DDP: params are views of one contiguous buffer, parked once
            assert res["n_buffers"] >= 1 and res["views_ok"]
            assert res["storages"] < res["tensors"]
    if mode != "plain":  # the DistributedOptimizer shards its state: each rank parks its own half
        shards = [sum(v.numel() for k, v in res["state"].items() if ".state" in k) for res in results]
        model = sum(v.numel() for k, v in results[0]["state"].items() if k.startswith("chunk0.module") and
                    "grad_data" not in k)
        assert shards[0] < 2 * model and shards[1] < 2 * model
