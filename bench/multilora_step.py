"""One batched LoRA step of N tenants on one shared base (rota_tinker._worker.multilora), against one tenant's step.

In one process, no service: a Qwen3-shaped snapshot written with ``save_pretrained`` and loaded with
``from_pretrained`` (as users' models are), N tenants each with rank-``--rank`` adapters on attention, MLP and
unembedding, each sending ``--batch`` x ``--seq-len`` tokens a step. Per N: the median wall time of one step
(a batched forward_backward over all N units, in micro-batches, then each tenant's AdamW step), its ratio to
N = 1 (what every tenant's step costs when all N step at once), tokens/s, and the device's peak memory with
the bytes each added tenant costs. The service-level figure (think time, arrivals, turns) is
``bench/tinker_density.py``; this is the device's side of it.

    python bench/multilora_step.py --device cuda:0 --model qwen3-1.7b --out bench/results/multilora-step-h200.json
    python bench/multilora_step.py --device cpu --model qwen3-tiny --dtype float32 --tenants 1,4 --steps 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time


def _step(engine: object, units: list, tenants: list[str], sync: object) -> float:
    t0 = time.perf_counter()
    engine.forward_backward(units)  # type: ignore[attr-defined]
    for t in tenants:
        engine.optim_step(t, {"learning_rate": 1e-4})  # type: ignore[attr-defined]
    sync()  # type: ignore[operator]
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model", default="qwen3-1.7b", help="a shape of rota_tinker.testing.QWEN3_SHAPES")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8, help="sequences per tenant per step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--tenants", default="1,8,16,32,48,64")
    p.add_argument("--steps", type=int, default=5, help="timed steps per N (median)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="")
    args = p.parse_args()
    counts = sorted({int(x) for x in args.tenants.split(",") if x.strip()})
    if not counts or counts[0] < 1 or args.steps < 1 or args.rank < 1:
        p.error("--tenants must be positive integers; --steps and --rank >= 1")

    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from rota_tinker._worker.multilora import BatchedLora, Unit
    from rota_tinker.testing import QWEN3_SHAPES, qwen3_shaped

    if args.model not in QWEN3_SHAPES:
        p.error(f"--model {args.model!r}: choose one of {sorted(QWEN3_SHAPES)}")
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    spec = qwen3_shaped(tempfile.mkdtemp(prefix="multilora-hub-"), args.model, args.dtype, weights=True)
    sys.stderr.write(f"snapshot {spec.name}: {spec.params() / 1e9:.2f}B parameters\n")
    targets = {"attn": True, "mlp": True, "unembed": True}
    rng = np.random.default_rng(0)

    def unit(tenant: str) -> Unit:
        data = []
        for _ in range(args.batch):
            toks = rng.integers(0, spec.vocab, size=args.seq_len + 1)
            data.append((toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(args.seq_len, np.float32)}))
        return Unit(tenant, data)

    rows = []
    for n in counts:
        model = AutoModelForCausalLM.from_pretrained(spec.path, dtype=getattr(torch, args.dtype),
                                                     local_files_only=True).to(device)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        base_bytes = torch.cuda.memory_allocated(device) if cuda else 0
        engine = BatchedLora(model, device)
        tenants = [f"t{i}" for i in range(n)]
        for i, t in enumerate(tenants):
            engine.add(t, args.rank, seed=i, targets=targets)
        times = []
        for step in range(args.warmup + args.steps):
            dt = _step(engine, [unit(t) for t in tenants], tenants, sync)
            if step >= args.warmup:
                times.append(dt)
        med = statistics.median(times)
        row = {"tenants": n, "median_step_s": med, "p90_step_s": sorted(times)[int(0.9 * (len(times) - 1))],
               "tokens_per_s": n * args.batch * args.seq_len / med,
               "peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None, "base_bytes": base_bytes}
        rows.append(row)
        sys.stderr.write(f"N={n}: step {med:.3f} s, {row['tokens_per_s']:.0f} tokens/s\n")
        del engine, model
        if cuda:
            torch.cuda.empty_cache()
    one = rows[0]["median_step_s"] if rows[0]["tenants"] == 1 else None
    for row in rows:
        row["step_vs_one_tenant"] = row["median_step_s"] / one if one else None
        if rows[0]["peak_bytes"] is not None and row["tenants"] > rows[0]["tenants"]:
            row["bytes_per_added_tenant"] = (row["peak_bytes"] - rows[0]["peak_bytes"]) / \
                (row["tenants"] - rows[0]["tenants"])
    result = {"bench": "multilora_step", "device": args.device, "host": platform.node(), "args": vars(args),
              "params": spec.params(), "torch": torch.__version__, "results": rows}
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
