"""Tenant density of rota-service-tinker: N LoRA tenants on one base model on one device.

Each tenant is a real ``tinker`` SDK client (its own API key, its own trainer worker
process) running ``forward_backward`` + ``optim_step`` steps on a LoRA model of one base
model; every work unit is a rota turn on the device's group. For N = 1, 2, 4, ... the
per-step latency (median over steps after ``--warmup``, across tenants) is measured,
and density is the largest N whose median per-step latency stays within ``--slack``
times the single-tenant latency: "tenants served per GPU at equal per-step latency",
with each tenant spending ``--think-s`` client-side between steps (rollouts, reward
scoring) during which others use the device. One tenant per GPU is the baseline (1).

    python bench/tinker_density.py --device cuda:0 --base rota/small --tenants 1,2,4,8 \
        --steps 20 --think-s 0.5 --out bench/results/tinker-density-h200.json
    python bench/tinker_density.py --device cpu --tenants 1,2 --steps 4 --think-s 0.2   # a smoke run

Not yet run on a GPU (no device time was left when it was written); the CPU smoke run
exercises the same code path.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

log = logging.getLogger("tinker_density")


def _batch(vocab: int, length: int, n: int, seed: int) -> list:
    from tinker import types

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = rng.integers(0, vocab, size=length + 1)
        target = types.TensorData.from_numpy(toks[1:].astype(np.int64))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
                               loss_fn_inputs={"target_tokens": target}))
    return out


def run_point(n: int, args: argparse.Namespace) -> dict:
    """N tenants concurrently; returns per-step latencies and the makespan."""
    import tinker
    from tinker import types

    from rota.testing import running_orchestrator
    from rota_tinker import DEFAULT_BASE_MODELS, ServiceConfig, Tenant, TinkerService

    base = DEFAULT_BASE_MODELS[args.base]
    tenants = tuple(Tenant(f"t{i}", f"tml-bench-tenant-{i:04d}") for i in range(n))
    with running_orchestrator() as (endpoint, _engine):
        config = ServiceConfig(tenants=tenants, data_dir=tempfile.mkdtemp(prefix="tinker-density-"),
                               device=args.device, group=f"density-{n}", endpoint=endpoint, long_poll_s=5.0)
        with TinkerService(config) as svc:
            clients = [tinker.ServiceClient(base_url=svc.url, api_key=t.api_key) for t in tenants]
            trainers = [c.create_lora_training_client(base_model=base.name, rank=args.rank, seed=i).result(600)
                        for i, c in enumerate(clients)]
            data = _batch(base.vocab, args.seq_len, args.batch, seed=0)
            lat: dict[str, list[float]] = {t.name: [] for t in tenants}
            errors: list[BaseException] = []
            start = threading.Barrier(n)

            def loop(i: int) -> None:
                try:
                    tc, name = trainers[i], tenants[i].name
                    start.wait(600)
                    for step in range(args.warmup + args.steps):
                        t0 = time.perf_counter()
                        fb = tc.forward_backward(data, "cross_entropy")
                        op = tc.optim_step(types.AdamParams(learning_rate=1e-4))
                        fb.result(600)
                        op.result(600)
                        if step >= args.warmup:
                            lat[name].append(time.perf_counter() - t0)
                        time.sleep(args.think_s)
                except BaseException as e:
                    errors.append(e)

            t0 = time.perf_counter()
            threads = [threading.Thread(target=loop, args=(i,)) for i in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(3600)
            makespan = time.perf_counter() - t0
            if errors:
                raise errors[0]
    every = [x for v in lat.values() for x in v]
    return {"tenants": n, "median_step_s": statistics.median(every), "p90_step_s": float(np.percentile(every, 90)),
            "per_tenant_median_s": {k: statistics.median(v) for k, v in lat.items()}, "makespan_s": makespan}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--base", default="rota/small", help="a base model of rota_tinker.DEFAULT_BASE_MODELS")
    p.add_argument("--tenants", default="1,2,4,8", help="comma-separated N values")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--think-s", type=float, default=0.5, help="client-side seconds between a tenant's steps")
    p.add_argument("--slack", type=float, default=1.10, help="equal latency = within this factor of N=1")
    p.add_argument("--out", default="")
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("ROTA_LOG_LEVEL", "WARNING"))
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    try:
        ns = sorted({int(x) for x in args.tenants.split(",") if x.strip()})
    except ValueError:
        p.error(f"--tenants {args.tenants!r} must be comma-separated integers")
    if not ns or ns[0] < 1:
        p.error("--tenants needs positive integers")
    from rota_tinker import DEFAULT_BASE_MODELS

    if args.base not in DEFAULT_BASE_MODELS:
        p.error(f"--base {args.base!r} unknown; choose one of {sorted(DEFAULT_BASE_MODELS)}")
    points = [run_point(n, args) for n in ns]
    base = next((pt for pt in points if pt["tenants"] == 1), None) or run_point(1, args)
    ok = [pt["tenants"] for pt in points if pt["median_step_s"] <= base["median_step_s"] * args.slack]
    result = {"bench": "tinker_density", "device": args.device, "host": platform.node(), "args": vars(args),
              "single_tenant_median_step_s": base["median_step_s"], "density": max(ok) if ok else 1,
              "points": points}
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    log.warning("density %s (tenants per device at <= %.2fx single-tenant step latency)", result["density"],
                args.slack)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
