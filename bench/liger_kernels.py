"""Whether liger-kernel's RMSNorm, SwiGLU and RoPE may replace the batched LoRA worker's, and what they save.

The rule for a fused kernel: its error against an fp32 reference no worse than the plain bf16 path's. On a
Qwen3-shaped snapshot (random weights written with ``save_pretrained``, loaded with ``from_pretrained``), three
engines of the batched LoRA worker (``rota_tinker._worker.multilora.BatchedLora``) get the same ``--tenants``
adapters (B drawn from a seed instead of peft's zeros, so that both A's and B's gradients are non-zero) and run
the same units (``--rows`` x ``--length`` tokens a tenant):

* ``fp32``: an fp32 base, the reference;
* ``bf16``: a bf16 base as the worker runs it (torch's fused RMSNorm where it is exact, its logprob kernels);
* ``liger``: the same bf16 base with liger-kernel's RMSNorm, SwiGLU and RoPE
  (``apply_liger_kernel_to_qwen3(model=...)``), applied only after the other two ran: liger replaces Qwen3's
  RoPE function for the whole ``modeling_qwen3`` module.

For each bf16 path: the logprobs' largest error against the fp32 engine's, each tenant's adapter gradients'
relative error (Frobenius, all its tensors together; the worst tenant), and forward_backward seconds (median of
``--repeats`` after a warm-up). liger-kernel needs CUDA (triton): elsewhere its row says why it is missing.

    python bench/liger_kernels.py --device cuda:0 --model qwen3-1.7b --out bench/results/liger-kernels-h200.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _units(unit_cls: Any, tenants: list[str], vocab: int, rows: int, length: int) -> list[Any]:
    rng = np.random.default_rng(0)
    out = []
    for t in tenants:
        data = []
        for _ in range(rows):
            toks = rng.integers(0, vocab, size=length + 1)
            data.append((toks[:-1], {"target_tokens": toks[1:], "weights": np.ones(length, np.float32)}))
        out.append(unit_cls(t, data))
    return out


def _engine(path: str, dtype: torch.dtype, dev: torch.device, tenants: list[str]) -> Any:
    from transformers import AutoModelForCausalLM

    from rota_tinker._worker.multilora import BatchedLora

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True).to(dev)
    engine = BatchedLora(model, dev)
    for i, t in enumerate(tenants):
        engine.add(t, 16, seed=i, targets={"attn": True, "mlp": True, "unembed": True})
        gen = torch.Generator().manual_seed(1000 + i)
        for _a, b in engine.adapters[t].layers.values():  # B as after some training: A's gradients non-zero
            b.data.copy_((torch.randn(b.shape, generator=gen) * 0.02).to(b.device))
    return engine


def _pass(engine: Any, units: list[Any]) -> tuple[list[np.ndarray], dict[str, torch.Tensor]]:
    """One forward_backward from zeroed gradients: each datum's logprobs, each tenant's gradients (fp64, flat)."""
    for adapter in engine.adapters.values():
        for p in adapter.parameters():
            p.grad.zero_()
    results = engine.forward_backward(units)
    logprobs = [np.asarray(lp, dtype=np.float64) for r in results for lp in r["logprobs"]]
    grads = {t: torch.cat([p.grad.double().flatten().cpu() for p in a.parameters()])
             for t, a in engine.adapters.items()}
    return logprobs, grads


def _time(engine: Any, units: list[Any], repeats: int, sync: Any) -> float:
    engine.forward_backward(units)  # warm-up (and any compile)
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        engine.forward_backward(units)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _errors(ref: tuple[list[np.ndarray], dict[str, torch.Tensor]],
            got: tuple[list[np.ndarray], dict[str, torch.Tensor]]) -> dict[str, float]:
    lp = max(float(np.max(np.abs(a - b))) for a, b in zip(ref[0], got[0], strict=True))
    grad = max(float((got[1][t] - g).norm() / g.norm().clamp_min(1e-30)) for t, g in ref[1].items())
    return {"logprob_max_abs_err": lp, "grad_rel_err": grad}


def _count(text: str) -> int:
    """An argument that counts something: an integer of at least 1."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer of at least 1")
    return n


def main() -> None:
    from rota_tinker._worker.multilora import Unit
    from rota_tinker.testing import QWEN3_SHAPES, qwen3_shaped

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--model", default="qwen3-1.7b", choices=sorted(QWEN3_SHAPES))
    p.add_argument("--tenants", type=_count, default=4)
    p.add_argument("--rows", type=_count, default=8, help="rows a tenant (default 8)")
    p.add_argument("--length", type=_count, default=256, help="tokens a row (default 256: 4 x 8 x 256 = 8,192)")
    p.add_argument("--repeats", type=_count, default=5)
    p.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = p.parse_args()
    dev = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    spec = qwen3_shaped(tempfile.mkdtemp(), args.model, "float32", weights=True)
    tenants = [f"t{i}" for i in range(args.tenants)]
    units = _units(Unit, tenants, spec.vocab, args.rows, args.length)
    print(f"{args.model} on {dev}: {args.tenants} tenants x {args.rows} x {args.length} tokens", flush=True)

    ref_engine = _engine(str(spec.path), torch.float32, dev, tenants)
    ref = _pass(ref_engine, units)
    del ref_engine
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows: dict[str, dict[str, Any]] = {}
    engine = _engine(str(spec.path), torch.bfloat16, dev, tenants)
    rows["bf16"] = {**_errors(ref, _pass(engine, units)),
                    "forward_backward_s": _time(engine, units, args.repeats, sync)}
    del engine
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3
    except ImportError as e:
        rows["liger"] = {"missing": f"liger-kernel is not importable here ({e})"}
    else:
        if dev.type != "cuda":
            rows["liger"] = {"missing": "liger-kernel's kernels are triton: CUDA only"}
        else:
            engine = _engine(str(spec.path), torch.bfloat16, dev, tenants)
            apply_liger_kernel_to_qwen3(rope=True, swiglu=True, rms_norm=True, cross_entropy=False,
                                        fused_linear_cross_entropy=False, model=engine.model)
            rows["liger"] = {**_errors(ref, _pass(engine, units)),
                             "forward_backward_s": _time(engine, units, args.repeats, sync)}
    for name, row in rows.items():
        if "missing" in row:
            print(f"{name:<6} {row['missing']}")
        else:
            print(f"{name:<6} forward_backward {row['forward_backward_s'] * 1e3:8.1f} ms  logprobs max abs err "
                  f"{row['logprob_max_abs_err']:.3g}  gradients rel err {row['grad_rel_err']:.3g}")
    verdict: dict[str, Any] = {}
    if "forward_backward_s" in rows.get("liger", {}):
        lig, plain = rows["liger"], rows["bf16"]
        verdict = {"liger_over_bf16_time": lig["forward_backward_s"] / plain["forward_backward_s"],
                   "liger_errors_no_worse": lig["logprob_max_abs_err"] <= plain["logprob_max_abs_err"]
                   and lig["grad_rel_err"] <= plain["grad_rel_err"]}
        print(f"liger / bf16 time {verdict['liger_over_bf16_time']:.3f}x; liger's errors no worse than bf16's: "
              f"{verdict['liger_errors_no_worse']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "bench": "liger_kernels", "device": str(dev),
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or "cpu",
            "torch": torch.__version__, "model": args.model, "tenants": args.tenants, "rows": args.rows,
            "length": args.length, "repeats": args.repeats, "reference": "the same engine on an fp32 base",
            "rows_by_path": rows, **verdict, "when": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
