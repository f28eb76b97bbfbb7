"""One process of a `torchrun --nproc-per-node N` tenant pod (for test_k8s_gpus.py).

``torchrun ... torchrun_worker.py OUTDIR`` with the pod's ROTA_* env: initialises
torch.distributed (gloo, CPU), then ``rota.connect()`` as the README says, takes two
turns with a collective inside each, and writes what rota saw as ``OUTDIR/rank<R>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")
    import rota

    gpu = rota.connect()
    tokens = []
    for _ in range(2):
        with gpu.turn() as grant:
            t = torch.ones(1)
            dist.all_reduce(t)  # every rank is inside the same turn
            tokens.append((grant.token, int(t.item())))
    seen = {"rank": gpu.rank, "world": gpu.world_size, "tenant": gpu.tenant, "group": gpu.group,
            "torch_rank": dist.get_rank(), "local_rank": int(os.environ["LOCAL_RANK"]), "tokens": tokens,
            "rota_env": sorted(k for k in os.environ if k in ("ROTA_RANK", "ROTA_WORLD_SIZE"))}
    gpu.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{seen['rank']}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    main()
