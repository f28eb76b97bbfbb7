"""Where a LoRA tenant's step goes on the device, and what one pass over several tenants' data costs.

Runs in one process, no service: a Qwen3-shaped base (random init from its config) with
peft LoRA adapters, the service's own ``batch_logprobs``/``datum_loss``. Measured per
variant (median of ``--reps`` after ``--warmup``): wall time of a forward_backward, the
device's busy time in it (the sum of its CUDA kernels' durations, from torch.profiler),
and peak memory. Variants:

* ``worker``: the service worker's forward_backward as written (per-datum loss and syncs);
* ``one_loss``: the same rows, one summed loss, one transfer of the logprobs;
* ``fp32_lora``: ``one_loss`` as peft computes LoRA alone (inputs cast to the fp32 adapters), not in the
  base's half precision as the service does (``rota_tinker._worker.models.lora_in_base_precision``);
* ``empty_cache``: ``worker`` after ``torch.cuda.empty_cache()`` (what a park with
  ``release_cached`` costs the next turn);
* ``rows_xK``: K times the rows through one adapter (the device's cost of a K-tenant pass);
* ``mixed_K``: K adapters, each on its own rows, in one pass (peft's per-row ``adapter_names``).

    python bench/lora_step_profile.py --device cuda:0 --model qwen3-1.7b --out bench/results/lora-step-profile-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="qwen3-tiny")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--tenants", default="2,4,8", help="K values for rows_xK and mixed_K")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--top-kernels", type=int, default=12, help="kernels with the most device time, per variant")
    p.add_argument("--only", default="", help="comma-separated variants to run (default: all)")
    p.add_argument("--procs", default="", help="K values: K processes stepping at once (each its own model)")
    args = p.parse_args()
    if args.procs:
        rows_: list = []
        for k in [int(x) for x in args.procs.split(",")]:
            concurrent(args.device, args.model, k, args.reps, args.batch, args.seq_len, rows_)
        if args.out:
            Path(args.out).write_text(json.dumps({"bench": "lora_step_profile", "args": vars(args), "results": rows_},
                                                 indent=1))
        return

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rota_tinker._worker.models import add_lora, batch_logprobs, build_base, datum_loss, lora_config
    from rota_tinker.testing import qwen3_shaped

    dev = torch.device(args.device)
    spec = qwen3_shaped(tempfile.mkdtemp(prefix="lora-profile-"), args.model, args.dtype)
    t0 = time.monotonic()
    base = build_base(spec, dev)
    targets = {"attn": True, "mlp": True, "unembed": True}
    cfg = lora_config(base, args.rank, targets)  # before peft wraps the linears
    model = add_lora(base, args.rank, 0, targets)
    build_s = time.monotonic() - t0
    vocab = model.config.vocab_size
    from collections import Counter

    print(json.dumps({"param_dtypes": dict(Counter(f"{p.dtype}:{p.requires_grad}" for p in model.parameters())),
                      "attn": getattr(model.config, "_attn_implementation", None)}), flush=True)
    gen = torch.Generator().manual_seed(0)

    def rows(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        toks = torch.randint(0, vocab, (n, args.seq_len + 1), generator=gen)
        return toks[:, :-1].to(dev), toks[:, 1:].to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def worker_step(m, toks, targets_, per_datum=True):
        lp = batch_logprobs(m, toks, targets_)
        if per_datum:
            loss, out = 0, []
            for b in range(toks.shape[0]):
                one = datum_loss("cross_entropy", lp[b], {"weights": torch.ones(args.seq_len, device=dev)})
                float(one.detach())
                loss = loss + one
            loss.backward()
            out = [lp[b].detach().float().cpu().numpy() for b in range(toks.shape[0])]
        else:
            loss = -lp.sum()
            loss.backward()
            out = lp.detach().float().cpu().numpy()
        return out

    def measure(name: str, fn, before=None) -> dict | None:
        if args.only and name not in args.only.split(","):
            return None
        walls, busy = [], []
        for i in range(args.warmup + args.reps):
            if before:
                before()
            sync()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            t = time.monotonic()
            if i == args.warmup + args.reps - 1 and dev.type == "cuda":
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    fn()
                    sync()
                kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
                busy.append(sum(e.device_time for e in kernels) / 1e6)
                n_kernels = len(kernels)
                by_name: dict = {}
                for e in kernels:
                    n, t = by_name.get(e.name, (0, 0.0))
                    by_name[e.name] = (n + 1, t + e.device_time / 1e6)
                top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:args.top_kernels]
            else:
                fn()
                sync()
                if i >= args.warmup:
                    walls.append(time.monotonic() - t)
        row = {"variant": name, "median_s": statistics.median(walls), "min_s": min(walls)}
        if dev.type == "cuda":
            row.update(device_busy_s=busy[0], kernels=n_kernels,
                       peak_gb=torch.cuda.max_memory_allocated(dev) / 1e9,
                       top_kernels=[{"name": k[:120], "count": n, "device_s": t} for k, (n, t) in top])
        print(json.dumps(row, indent=1), flush=True)
        return row

    for prm in model.parameters():
        prm.grad = None
    results = []
    toks, tg = rows(args.batch)
    results.append(measure("worker", lambda: worker_step(model, toks, tg)))
    results.append(measure("one_loss", lambda: worker_step(model, toks, tg, per_datum=False)))

    def peft_fp32_lora() -> None:  # peft's own path: every LoRA input cast to the adapters' fp32
        out = model(toks, use_cache=False).logits.float()
        lp = torch.gather(torch.log_softmax(out, -1), 2, tg.unsqueeze(2)).squeeze(2)
        (-lp.sum()).backward()
        lp.detach().float().cpu()
    results.append(measure("fp32_lora", peft_fp32_lora))
    if dev.type == "cuda":
        results.append(measure("empty_cache", lambda: worker_step(model, toks, tg), before=torch.cuda.empty_cache))
    ks = [int(k) for k in args.tenants.split(",")]
    for k in ks:
        tk, gk = rows(args.batch * k)
        results.append(measure(f"rows_x{k}", lambda tk=tk, gk=gk: worker_step(model, tk, gk, per_datum=False)))
        del tk, gk
    # K adapters in one pass: peft's mixed batches (rows name their adapter); eval mode is what peft requires
    kmax = max(ks)
    for a in range(1, kmax):
        model.add_adapter(f"t{a}", cfg)
    for prm in model.parameters():
        prm.requires_grad_(False)
    for name, prm in model.named_parameters():
        if "lora_" in name:
            prm.requires_grad_(True)
    model.eval()
    for k in ks:
        tk, gk = rows(args.batch * k)
        names = [("default" if a == 0 else f"t{a}") for a in range(k) for _ in range(args.batch)]

        def mixed(tk=tk, gk=gk, names=names):
            out = model(tk, use_cache=False, adapter_names=names)
            lp = torch.gather(torch.log_softmax(out.logits.float(), -1), 2, gk.unsqueeze(2)).squeeze(2)
            (-lp.sum()).backward()
            return lp.detach().float().cpu().numpy()
        results.append(measure(f"mixed_{k}", mixed))
    results = [r for r in results if r is not None]  # the variants --only left out
    doc = {"bench": "lora_step_profile", "args": vars(args), "device": args.device, "build_s": build_s,
           "torch": torch.__version__, "params": sum(x.numel() for x in base.parameters()), "results": results}
    if dev.type == "cuda":
        doc["gpu"] = torch.cuda.get_device_name(dev)
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    print(json.dumps({r["variant"]: round(r["median_s"] * 1e3, 1) for r in results}))


def concurrent(args_device: str, model_name: str, k: int, reps: int, batch: int, seq_len: int, out_q) -> None:
    """K processes, each its own base + LoRA, stepping at once (lockstep): the median step of each."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    barrier = ctx.Barrier(k)
    q = ctx.Queue()
    procs = [ctx.Process(target=_one, args=(args_device, model_name, reps, batch, seq_len, barrier, q))
             for _ in range(k)]
    for pr in procs:
        pr.start()
    got = [q.get(timeout=600) for _ in procs]
    for pr in procs:
        pr.join()
    out_q.append({"variant": f"procs_{k}", "per_process_median_s": got,
                  "median_s": statistics.median(got)})
    print(json.dumps(out_q[-1]), flush=True)


def _one(device: str, model_name: str, reps: int, batch: int, seq_len: int, barrier, q) -> None:
    import torch

    from rota_tinker._worker.models import add_lora, batch_logprobs, build_base
    from rota_tinker.testing import qwen3_shaped

    dev = torch.device(device)
    spec = qwen3_shaped(tempfile.mkdtemp(prefix="lora-profile-"), model_name, "bfloat16")
    model = add_lora(build_base(spec, dev), 16, 0, {"attn": True, "mlp": True, "unembed": True})
    toks = torch.randint(0, model.config.vocab_size, (batch, seq_len + 1))
    x, y = toks[:, :-1].to(dev), toks[:, 1:].to(dev)
    walls = []
    for i in range(2 + reps):
        barrier.wait()
        t = time.monotonic()
        lp = batch_logprobs(model, x, y)
        (-lp.sum()).backward()
        lp.detach().float().cpu()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 2:
            walls.append(time.monotonic() - t)
    q.put(statistics.median(walls))


if __name__ == "__main__":
    main()
