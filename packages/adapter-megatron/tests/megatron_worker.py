"""One rank of a 2-rank Megatron-Core job on gloo (CPU, with rota_megatron.cpu_shim).

Usage: megatron_worker.py MODE RANK WORLD MASTER_PORT ENDPOINT OUT
Trains the same seed twice: without rota (reference), then tracked by rota_megatron and
parked + restored every step; writes both trajectories and park facts to OUT.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
from megatron_testlib import build, snapshot, train_step

STEPS = 6


def main() -> None:
    mode, rank, world, port, endpoint, out = sys.argv[1:7]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.INFO)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from rota_megatron import cpu_shim

    cpu_shim.install()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)

    chunks, opt = build(mode)
    ref_losses = [train_step(mode, chunks, opt, i, rank) for i in range(STEPS)]
    ref_state = snapshot(chunks, opt)
    del chunks, opt

    import rota
    import rota_megatron
    from rota_megatron import ddp_buffers

    gpu = rota.connect(group="g", tenant=f"megatron-{mode}", endpoint=endpoint)
    assert (gpu.rank, gpu.world_size) == (rank, world)
    chunks, opt = build(mode)
    tracked = rota_megatron.track(gpu, chunks, opt)
    buffers = [b for c in chunks for b in ddp_buffers(c)]
    losses, freed, by_tag = [], [], {}
    for i in range(STEPS):
        with gpu.turn():
            losses.append(train_step(mode, chunks, opt, i, rank))
        dist.barrier()  # every rank has released before any rank asks for the next turn
        result = gpu.park()
        by_tag = dict(result.by_tag)
        tensors = [p for c in chunks for p in c.parameters()] + [b.grad_data for b in buffers]
        tensors += [b.param_data for b in buffers if b.param_data is not None]
        for leaf in rota_megatron.leaf_optimizers(opt):  # read from the optimizer itself, not from the adapter
            inner = leaf if isinstance(leaf, torch.optim.Optimizer) else leaf.optimizer
            mains = [p for g in inner.param_groups for p in g["params"]]
            tensors += mains + [v for m in mains for v in inner.state[m].values()
                                if isinstance(v, torch.Tensor) and v.dim() > 0]
        freed.append(all(t.untyped_storage().nbytes() == 0 for t in tensors))
    storages = len(tracked.parker._slots)
    n_tensors = sum(1 for _ in tracked.parker.named_tensors())
    with gpu.turn():
        state = snapshot(chunks, opt)
        views_ok = all(p.untyped_storage()._cdata == b.param_data.untyped_storage()._cdata
                       for b in buffers if b.param_data is not None for p in b.params)
    torch.save({"ref_losses": ref_losses, "ref_state": ref_state, "losses": losses, "state": state,
                "freed": freed, "storages": storages, "tensors": n_tensors, "by_tag": by_tag,
                "views_ok": views_ok, "n_buffers": len(buffers),
                "allocations": tracked.parker.pool.allocations}, out)
    tracked.untrack()
    gpu.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
