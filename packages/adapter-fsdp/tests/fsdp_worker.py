"""One rank of a 2-rank job on gloo (FSDP2 or DDP), run by test_fsdp_distributed.py.

Usage: fsdp_worker.py MODE RANK WORLD MASTER_PORT ENDPOINT OUT
Trains the same seed twice: without rota (reference), then tracked by rota_fsdp and
parked + restored every step; writes both trajectories to OUT (torch.save).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fsdp_testlib import make_model, make_optimizer, snapshot, train_step

STEPS = 20


def build(mode: str) -> torch.nn.Module:
    model = make_model(0)
    if mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model


def main() -> None:
    mode, rank, world, port, endpoint, out = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)

    model = build(mode)
    opt = make_optimizer(model)
    ref_losses = [train_step(model, opt, i, rank) for i in range(STEPS)]
    ref_state = snapshot(model, opt)

    import rota
    import rota_fsdp

    gpu = rota.connect(group="g", tenant=f"{mode}-job", endpoint=endpoint)
    assert (gpu.rank, gpu.world_size) == (rank, world)
    model = build(mode)
    opt = make_optimizer(model)
    tracked = rota_fsdp.track(gpu, model, opt)
    losses, freed, storages = [], [], 0
    for i in range(STEPS):
        with gpu.turn():
            losses.append(train_step(model, opt, i, rank))
        dist.barrier()  # every rank has released before any rank asks for the next turn
        gpu.park()
        locals_ = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        freed.append(all(t.untyped_storage().nbytes() == 0 for t in locals_))
        storages = len(tracked.parker._slots)
    with gpu.turn():
        state = snapshot(model, opt)
    tensors = sum(1 for _ in tracked.parker.named_tensors())
    torch.save({"ref_losses": ref_losses, "ref_state": ref_state, "losses": losses, "state": state,
                "freed": freed, "storages": storages, "tensors": tensors,
                "sharded": any(hasattr(p, "_local_tensor") for p in model.parameters()),
                "allocations": tracked.parker.pool.allocations}, out)
    tracked.untrack()
    gpu.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
