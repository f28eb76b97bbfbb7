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


def _kept_buffer_is_freed_by_park(gpu, model) -> dict[str, bool]:
    """FSDP2 keeps collective buffers between iterations; a park must drop them (they are caches).

    torch 2.11 kept the last reduce-scatter input as ``comm_ctx.reduce_scatter_state`` until the
    next backward (2112 MiB per rank on the H200); torch >= 2.12 keeps a list and clears it at the
    end of backward. Here a buffer is put where each version keeps it, then the tenant parks.
    """
    import weakref

    from torch.distributed.fsdp._fully_shard._fsdp_param_group import ReduceScatterState

    ctx = model._get_fsdp_state()._comm_ctx
    freed = {}
    for form in ("torch 2.11 attribute", "torch 2.12 list"):
        kept = torch.ones(1 << 16)
        ref = weakref.ref(kept)
        if form.endswith("attribute"):
            ctx.reduce_scatter_state = ReduceScatterState(kept, None)
        else:
            ctx.reduce_scatter_states.append(ReduceScatterState(kept, None))
        del kept
        gpu.park()
        freed[form] = ref() is None
        with gpu.turn():
            pass
    return freed


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
    kept_freed = _kept_buffer_is_freed_by_park(gpu, model) if mode == "fsdp2" else None
    tensors = sum(1 for _ in tracked.parker.named_tensors())
    torch.save({"ref_losses": ref_losses, "ref_state": ref_state, "losses": losses, "state": state,
                "freed": freed, "storages": storages, "tensors": tensors,
                "sharded": any(hasattr(p, "_local_tensor") for p in model.parameters()),
                "allocations": tracked.parker.pool.allocations, "kept_freed": kept_freed}, out)
    tracked.untrack()
    gpu.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
