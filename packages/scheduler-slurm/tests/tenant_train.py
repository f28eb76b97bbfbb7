"""A small CPU training tenant (linear regression, SGD) for the Slurm tests.

``python tenant_train.py SEED OUT.json`` trains inside ``rota.connect()`` turns (group,
tenant and orchestrator come from the env the SPANK plugin sets); with ``--dedicated``
it trains without rota, which gives the reference losses. Each turn is logged as
(token, start, end) in wall-clock seconds so the test can check turns never overlap.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

STEPS = 6
TURN_WORK_S = 0.15  # keeps each turn long enough that an overlap could not hide


def main() -> None:
    seed, out = int(sys.argv[1]), sys.argv[2]
    dedicated = "--dedicated" in sys.argv
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(STEPS, 32, 16, generator=gen)
    y = x.sum(dim=2, keepdim=True) * 0.5
    gpu = None
    if not dedicated:
        import rota

        gpu = rota.connect()
    losses, turns = [], []
    for step in range(STEPS):
        time.sleep(0.05)  # "rollout": no device needed
        ctx = gpu.turn() if gpu is not None else contextlib.nullcontext(None)
        with ctx as grant:
            t0 = time.time()
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x[step]), y[step])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            time.sleep(TURN_WORK_S)
            turns.append([grant.token if grant is not None else 0, t0, time.time()])
    env = {k: v for k, v in os.environ.items() if k.startswith("ROTA_")}
    if gpu is not None:
        gpu.close()
    with open(out, "w") as f:
        json.dump({"losses": losses, "turns": turns, "env": env}, f)


if __name__ == "__main__":
    main()
