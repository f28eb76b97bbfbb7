"""One process, one GPU: an FSDP2 (``fully_shard``, NCCL, world of 1) model trained with AdamW, tracked by
rota_fsdp and parked + restored every step, against the same steps unparked; run by test_adapters_cuda.py.

Usage: fsdp2_cuda_worker.py MASTER_PORT ENDPOINT   (prints one JSON line)
After every park it reads NVML for this process: what the park left beside the CUDA context and NCCL.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch
import torch.distributed as dist

STEPS = 4
WIDTH, DEPTH, BATCH = 4096, 8, 64
BIG = 32 << 20  # live allocator blocks at least this large are described when a park fails


def build() -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)]).cuda()
    mesh = init_device_mesh("cuda", (1,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> float:
    g = torch.Generator().manual_seed(i)
    x = torch.randn(BATCH, WIDTH, generator=g).cuda()
    loss = model(x).float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    return float(loss)


def describe_failed_park(model: torch.nn.Module, i: int) -> None:
    """On stderr: FSDP2's state per module and where each large live block was allocated (with
    ROTA_FSDP_HISTORY=1). It showed what an H100's failed parks had left: blocks from before the tracked phase."""
    from torch.distributed.fsdp import FSDPModule

    print(f"park after step {i} failed; FSDP2 state:", file=sys.stderr)
    for name, m in model.named_modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = getattr(state, "_fsdp_param_groups", None) or [getattr(state, "_fsdp_param_group", None)]
            for g in filter(None, groups):
                print(f"  {name or '<root>'}: training_state={g._training_state} is_sharded={g.is_sharded} "
                      f"all_gather_result={getattr(g, '_all_gather_result', None) is not None} "
                      f"params={[str(p.sharded_state) for p in g.fsdp_params]}", file=sys.stderr)
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and block["size"] >= BIG:
                frames = [f"{f['filename']}:{f['line']} {f['name']}" for f in block.get("frames", [])
                          if f["filename"].endswith(".py")][:14]
                print(f"  live block {block['size'] >> 20} MiB, allocated at:\n    " + "\n    ".join(frames),
                      file=sys.stderr)


def main() -> None:
    port, endpoint = sys.argv[1:3]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, CUBLAS_WORKSPACE_CONFIG=":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    from rota_torch import process_device_bytes

    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    reference = [step(model, opt, i) for i in range(STEPS)]
    del model, opt
    gc.collect()  # FSDP2's modules and hooks form reference cycles: the reference model is freed only here
    torch.cuda.empty_cache()
    baseline = process_device_bytes("cuda:0")  # the context, NCCL and cuBLAS, with no model

    import rota
    import rota_fsdp

    gpu = rota.connect(group="fsdp2-cuda", tenant="fsdp2", endpoint=endpoint)
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tracked = rota_fsdp.track(gpu, model, opt)
    tracked.prepare()
    if os.environ.get("ROTA_FSDP_HISTORY") == "1":  # allocation stacks for describe_failed_park (slows each step)
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    losses, after_park, parked = [], [], []
    for i in range(STEPS):
        with gpu.turn():
            losses.append(step(model, opt, i))
        try:
            result = gpu.park()
        except Exception:
            describe_failed_park(model, i)
            raise
        parked.append(result.bytes_moved)
        after_park.append(process_device_bytes("cuda:0"))
    with gpu.turn():
        pass
    out = {"reference": reference, "losses": losses, "baseline_bytes": baseline, "after_park_bytes": after_park,
           "parked_bytes": parked, "state_bytes": sum(tracked.footprint().values()),
           "failed": gpu.stats.failed("park") + gpu.stats.failed("restore")}
    tracked.untrack()
    gpu.close()
    dist.destroy_process_group()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
