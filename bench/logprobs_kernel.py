"""The batched LoRA worker's per-token logprobs: the compiled kernels against the eager fp32 chunks.

``rota_tinker._worker.kernels.token_logprobs`` takes half-precision logits ``[tokens, vocab]`` and gives
``log_softmax(logits.float())`` at the targets, and its backward the gradient of the logits. On CUDA it runs two
kernels made by ``torch.compile`` (``kernels.FUSED``); otherwise fp32 chunks in eager torch. This measures, in one
run and on the same logits (a LoRA pass's shape: 32 x 256 tokens, Qwen3's 151,936-entry vocabulary):

* forward and forward+backward seconds of each path (median of ``--repeats``, after a warm-up that includes the
  compile), and their ratio;
* each path's error against an fp64 reference on ``--check-rows`` rows: the logprobs (max abs) and the logits'
  gradient (max abs, and relative to the gradient's largest entry). The fused path is acceptable when its errors
  are no larger than the eager path's.

    python bench/logprobs_kernel.py --device cuda:0 --out bench/results/logprobs-kernel-h100.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
from torch.nn import functional as F


def _run(kernels: object, fused: bool, logits: torch.Tensor, targets: torch.Tensor, upstream: torch.Tensor,
         repeats: int, sync: object) -> dict:
    kernels.FUSED = fused  # type: ignore[attr-defined]
    fwd, both = [], []
    grad = None
    for i in range(repeats + 1):  # the first is a warm-up (and the compile)
        x = logits.detach().requires_grad_(True)
        sync()
        t0 = time.perf_counter()
        lp = kernels.token_logprobs(x, targets)  # type: ignore[attr-defined]
        sync()
        t1 = time.perf_counter()
        (lp * upstream).sum().backward()
        sync()
        t2 = time.perf_counter()
        if i:
            fwd.append(t1 - t0)
            both.append(t2 - t0)
        grad = x.grad
    return {"forward_s": statistics.median(fwd), "forward_backward_s": statistics.median(both),
            "logprobs": lp.detach(), "grad": grad}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--tokens", type=int, default=32 * 256, help="rows of logits (default 8192: 32 x 256 tokens)")
    p.add_argument("--vocab", type=int, default=151936, help="vocabulary (default Qwen3's 151,936)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-rows", type=int, default=512, help="rows compared against fp64 (default 512)")
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    for name in ("tokens", "vocab", "repeats", "check_rows"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    from rota_tinker._worker import kernels

    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(args.tokens, args.vocab, device=dev, generator=gen) * 3).bfloat16()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=dev, generator=gen)
    upstream = torch.randn(args.tokens, device=dev, generator=gen)
    runs = {name: _run(kernels, fused, logits, targets, upstream, args.repeats, sync)
            for name, fused in (("eager", False), ("fused", True))}
    rows = slice(0, min(args.check_rows, args.tokens))
    ref = logits[rows].double().requires_grad_(True)
    ref_lp = F.log_softmax(ref, -1).gather(1, targets[rows, None]).squeeze(1)
    (ref_lp * upstream[rows].double()).sum().backward()
    scale = float(ref.grad.abs().max())
    out: dict = {"bench": "logprobs_kernel", "device": str(dev), "host": platform.node(),
                 "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                 "torch": torch.__version__, "args": {k: str(v) for k, v in vars(args).items()},
                 "fused_path": kernels.fused_logprobs(), "paths": {}}
    for name, r in runs.items():
        lp_err = float((r["logprobs"][rows].double() - ref_lp.detach()).abs().max())
        grad_err = float((r["grad"][rows].double() - ref.grad).abs().max())
        out["paths"][name] = {"forward_s": r["forward_s"], "forward_backward_s": r["forward_backward_s"],
                              "logprobs_max_abs_err": lp_err, "grad_max_abs_err": grad_err,
                              "grad_max_rel_err": grad_err / scale if scale else 0.0}
    e, f = out["paths"]["eager"], out["paths"]["fused"]
    out["fused_over_eager"] = {"forward": f["forward_s"] / e["forward_s"],
                               "forward_backward": f["forward_backward_s"] / e["forward_backward_s"]}
    out["fused_no_worse"] = (f["logprobs_max_abs_err"] <= e["logprobs_max_abs_err"] * 1.01 + 1e-7
                             and f["grad_max_abs_err"] <= e["grad_max_abs_err"] * 1.01)
    for name, r in out["paths"].items():
        print(f"{name:6s} forward {r['forward_s'] * 1e3:8.2f} ms  forward+backward "
              f"{r['forward_backward_s'] * 1e3:8.2f} ms  logprob err {r['logprobs_max_abs_err']:.3g}  "
              f"grad err {r['grad_max_abs_err']:.3g} ({r['grad_max_rel_err']:.3g} of the largest)")
    print(f"fused / eager: forward {out['fused_over_eager']['forward']:.3f}x, forward+backward "
          f"{out['fused_over_eager']['forward_backward']:.3f}x; fused errors no worse than eager: "
          f"{out['fused_no_worse']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1))
    raise SystemExit(0 if out["fused_no_worse"] else 1)


if __name__ == "__main__":
    main()
