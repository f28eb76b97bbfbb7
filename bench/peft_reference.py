"""The reference a user would run instead of a tenant: a single-tenant Hugging Face + peft LoRA trainer.

``bench/tinker_density.py`` measures it in the same run, before the tenant points, in a process of its own
(so its memory and CUDA context are gone before the service starts), and defines density against its median
step ``t_ref``. The same model snapshot (``from_pretrained``; a config-only snapshot random-inits from seed 0
on the device, as the service does), LoRA rank, batch (``--batch`` rows x ``--seq-len`` tokens, the same
random next-token rows as the tenants') and loss as the tenants' ``forward_backward`` + ``optim_step``, with
the settings a careful user picks (each written into the JSON as ``reference.settings``):

* base in the snapshot's dtype (bf16 on the H200; the CPU smoke runs use fp32), the step under
  ``torch.autocast`` in that dtype when it is half precision (what the HF Trainer's ``bf16=True`` does);
  peft's adapters stay fp32 (its ``autocast_adapter_dtype`` default);
* ``torch.backends.cuda.matmul.allow_tf32`` and ``cudnn.allow_tf32`` on; ``attn_implementation="sdpa"``;
* peft ``LoraConfig(r=rank, lora_alpha=32, lora_dropout=0.0)`` on every linear the tenants' default adapters
  take (attention, MLP and unembedding: q/k/v/o, gate/up/down, lm_head);
* ``model.train()``, no gradient checkpointing, ``use_cache=False``, no attention mask (pad-free rows of one
  length), no ``torch.compile``;
* the loss the tenants' ``cross_entropy`` is: the sum over tokens of -log p(target), logits in fp32;
* ``torch.optim.AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0)`` (the tinker SDK's defaults),
  ``fused=True`` on CUDA; ``zero_grad(set_to_none=True)``.

A step is forward, backward, ``optimizer.step()`` and ``zero_grad`` then a device synchronise; ``t_ref`` is the
median of ``--ref-steps`` steps after ``--ref-warmup``. MFU (here and for every tenant point) counts
4 x P x tokens FLOPs a step for a LoRA step over a frozen base of P parameters (forward 2PT, backward's
activation gradients 2PT, no weight gradients for the base; the adapters' own FLOPs are left out), over the
device's dense bf16 peak (:data:`PEAK_BF16_FLOPS`); on CPU, or a device not in the table, MFU is null with the
reason.

    python bench/peft_reference.py --snapshot DIR --device cuda:0 --rank 16 --batch 8 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time

import numpy as np

# Dense (no sparsity) bf16 tensor-core peak, FLOP/s, by a name nvidia-smi reports; the first match wins.
PEAK_BF16_FLOPS = (("H200", 989.5e12), ("H100 SXM", 989.5e12), ("H100 80GB HBM3", 989.5e12),
                   ("H100 PCIe", 756.5e12), ("A100", 312e12))
FLOPS_PER_PARAM_TOKEN = 4  # LoRA over a frozen base: forward 2PT + backward's activation gradients 2PT
MFU_DEFINITION = ("mfu = 4 x base_params x tokens/s / the device's dense bf16 peak (LoRA over a frozen base: "
                  "forward 2PT, backward's activation gradients 2PT, no base weight gradients)")
LORA_ALPHA = 32  # the service's (rota_tinker's LORA_ALPHA)
LORA_LEAVES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def rows(vocab: int, length: int, n: int, seed: int) -> list[np.ndarray]:
    """``n`` random rows of ``length + 1`` token ids (inputs ``[:-1]``, next-token targets ``[1:]``)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, size=length + 1) for _ in range(n)]


def gpu_index(device: str) -> int | None:
    m = re.match(r"^cuda(?::(\d+))?$", device)
    return None if m is None else int(m.group(1) or 0)


def nvidia_smi(device: str, field: str) -> str | None:
    """``nvidia-smi --query-gpu=FIELD`` of ``device``; None on CPU, without nvidia-smi or on an error."""
    idx = gpu_index(device)
    if idx is None or shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", f"--id={idx}", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    return out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None


def peak_flops(device: str) -> dict:
    """The device's dense bf16 peak: ``{"device_name", "peak_bf16_flops", "reason"}`` (the peak None with why)."""
    if gpu_index(device) is None:
        return {"device_name": "cpu", "peak_bf16_flops": None, "reason": "CPU: no bf16 tensor-core peak to divide by"}
    name = nvidia_smi(device, "name")
    if name is None:
        return {"device_name": None, "peak_bf16_flops": None, "reason": "nvidia-smi gave no device name"}
    peak = next((f for key, f in PEAK_BF16_FLOPS if key in name), None)
    return {"device_name": name, "peak_bf16_flops": peak,
            "reason": None if peak else f"{name!r} is not in bench/peft_reference.py's PEAK_BF16_FLOPS"}


def mfu(tokens_per_s: float, params: int, peak: dict) -> float | None:
    return None if not peak["peak_bf16_flops"] else FLOPS_PER_PARAM_TOKEN * params * tokens_per_s / peak[
        "peak_bf16_flops"]


def measure(snapshot: str, has_weights: bool, dtype_name: str, device_name: str, rank: int, batch: int,
            seq_len: int, steps: int, warmup: int) -> dict:
    """The reference's steps, in this process (see the module docstring); its JSON."""
    import peft
    import torch
    import transformers
    from torch.nn import functional as F
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device, dtype = torch.device(device_name), getattr(torch, dtype_name)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if has_weights:
        model = AutoModelForCausalLM.from_pretrained(snapshot, dtype=dtype, local_files_only=True,
                                                     attn_implementation="sdpa").to(device)
    else:  # a config-only snapshot: random init from seed 0 on the device, as the service does
        with torch.random.fork_rng(devices=[device] if cuda else []), device:
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(snapshot, local_files_only=True),
                                                     dtype=dtype, attn_implementation="sdpa")
    leaves = {n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    targets = sorted(set(LORA_LEAVES) & leaves)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=rank, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                       target_modules=targets))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    fused = cuda
    opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0, fused=fused)
    data = torch.tensor(np.stack(rows(model.config.vocab_size, seq_len, batch, seed=0)), device=device)
    tokens, targets_t = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    half = dtype in (torch.bfloat16, torch.float16)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def step() -> float:
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=half):
            logits = model(input_ids=tokens, use_cache=False).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets_t.flatten(), reduction="sum")
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    times = [step() for _ in range(steps)]
    if cuda:
        memory = {"metric": "torch.cuda.max_memory_allocated/reserved (measured steps)",
                  "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
                  "peak_reserved_bytes": torch.cuda.max_memory_reserved(device)}
    else:
        import resource

        memory = {"metric": "the process's peak RSS (ru_maxrss)",
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    p50 = float(np.median(times))
    return {"t_ref_s": {"p50": p50, "p90": float(np.percentile(times, 90))}, "steps_s": times,
            "tokens_per_step": batch * seq_len, "tokens_per_s": batch * seq_len / p50,
            "base_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
            "lora_params": sum(p.numel() for p in trainable), "peak_memory": memory,
            "settings": {"framework": f"transformers {transformers.__version__} + peft {peft.__version__}, "
                                      f"torch {torch.__version__}",
                         "device": device_name, "base_dtype": dtype_name, "weights": "snapshot" if has_weights
                         else "random init (seed 0) from the snapshot's config",
                         "autocast": dtype_name if half else None, "adapter_dtype": "float32 (peft's default)",
                         "tf32_matmul": cuda, "attn_implementation": "sdpa", "gradient_checkpointing": False,
                         "mode": "model.train()", "use_cache": False, "torch_compile": False,
                         "rows": f"{batch} x {seq_len} tokens, pad-free, one length, no attention mask",
                         "loss": "sum over tokens of -log p(target) (tinker's cross_entropy), logits in fp32",
                         "lora": {"r": rank, "lora_alpha": LORA_ALPHA, "lora_dropout": 0.0,
                                  "target_modules": targets},
                         "optimizer": f"torch.optim.AdamW(lr=1e-4, betas=(0.9, 0.95), eps=1e-12, "
                                      f"weight_decay=0.0, fused={fused})", "zero_grad": "set_to_none=True",
                         "steps": steps, "warmup": warmup}}


def run_reference(spec: object, args: argparse.Namespace, peak: dict) -> dict:
    """:func:`measure` in a child process for ``spec`` (an ``HfModelSpec``) and the bench's ``args``: the JSON's
    ``reference``, with tokens/s and MFU; ``{"failed": True, "reason": ...}`` if it could not run."""
    cmd = [sys.executable, __file__, "--snapshot", spec.path, "--dtype", spec.dtype,  # type: ignore[attr-defined]
           "--device", args.device, "--rank", str(args.rank), "--batch", str(args.batch),
           "--seq-len", str(args.seq_len), "--steps", str(args.ref_steps), "--warmup", str(args.ref_warmup)]
    if spec.has_weights:  # type: ignore[attr-defined]
        cmd.append("--has-weights")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.point_timeout_s)
    except subprocess.TimeoutExpired:
        return {"failed": True, "reason": f"ran past --point-timeout-s {args.point_timeout_s}"}
    if proc.returncode != 0:
        return {"failed": True, "reason": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    ref = json.loads(proc.stdout.strip().splitlines()[-1])
    ref["mfu"] = mfu(ref["tokens_per_s"], spec.params(), peak)  # type: ignore[attr-defined]
    ref["mfu_null_reason"] = peak["reason"] if ref["mfu"] is None else None
    return ref


def annotate(pt: dict, args: argparse.Namespace, params: int, peak: dict, ref: dict | None) -> None:
    """A point's tokens/s, MFU and (with a reference) its p50 and p90 step against ``t_ref``."""
    if pt.get("failed"):
        return
    pt["step_tokens_per_s"] = args.batch * args.seq_len / pt["median_step_s"]  # one tenant's own rate
    pt["mfu"] = mfu(pt["aggregate_tokens_per_s"], params, peak)  # of all tenants' tokens over the window
    pt["mfu_null_reason"] = peak["reason"] if pt["mfu"] is None else None
    if ref is not None:
        t_ref = ref["t_ref_s"]["p50"]
        pt["p50_vs_ref"], pt["p90_vs_ref"] = pt["median_step_s"] / t_ref, pt["p90_step_s"] / t_ref
        pt["within_tolerance_of_ref"] = pt["p50_vs_ref"] <= args.tolerance


def prepare(result: dict, spec: object, args: argparse.Namespace) -> tuple[dict | None, float | None]:
    """Before the tenant points: run the reference into ``result["reference"]`` (a toy model, or ``--ref-steps 0``:
    skipped, with the reason); (the reference, or None, and the think time: ``--think-s``, else ``--think-ratio``
    x ``t_ref``, else None: the N = 1 point calibrates it)."""
    if args.model == "toy" or not args.ref_steps:
        result["reference"] = {"skipped": True, "reason": "the toy model is not a Hugging Face model"
                               if args.model == "toy" else "--ref-steps 0"}
    else:
        result["reference"] = run_reference(spec, args, result["device_peak"])
    reference = result["reference"] if "t_ref_s" in result["reference"] else None
    think_s = args.think_s
    if think_s is None and reference is not None:
        think_s = args.think_ratio * reference["t_ref_s"]["p50"]
    result["think_basis"] = ("--think-s" if args.think_s is not None else "think_ratio x t_ref" if reference
                             else "think_ratio x the N=1 back-to-back step")
    return reference, think_s


def set_densities(result: dict, reference: dict | None, tolerance: float) -> None:
    """``density_vs_one_tenant`` (the largest tested N such that it and every smaller tested N are within
    tolerance of N = 1), ``density_vs_reference`` (the largest tested N whose p50 step, and, beside it, p90 step,
    is <= tolerance x ``t_ref``) and ``density``: the latter, or without a reference the former."""
    density = 1
    for pt in result["points"]:
        if pt.get("failed") or not pt["within_tolerance"]:
            break
        density = pt["tenants"]
    result["density_vs_one_tenant"] = density
    if reference is None:
        result["density_vs_reference"], result["density"] = None, density
        return
    done = [p for p in result["points"] if not p.get("failed")]
    limit = tolerance * reference["t_ref_s"]["p50"]
    result["density_vs_reference"] = {
        "density": max((p["tenants"] for p in done if p["median_step_s"] <= limit), default=0),
        "density_p90": max((p["tenants"] for p in done if p["p90_step_s"] <= limit), default=0),
        "t_ref_s": reference["t_ref_s"]["p50"], "tolerance": tolerance, "limit_s": limit,
        "rule": "largest tested N whose p50 (density_p90: p90) step <= tolerance x t_ref p50; 0: none"}
    result["density"] = result["density_vs_reference"]["density"]


def summary(result: dict) -> str:
    """The run's summary line: every point's step against t_ref (p50/p90) and one tenant, tokens/s and MFU."""
    ref, parts = result.get("reference") or {}, []
    for pt in result["points"]:
        if pt.get("failed"):
            parts.append(f"N={pt['tenants']} failed")
            continue
        vs = f"{pt['p50_vs_ref']:.2f}x/{pt['p90_vs_ref']:.2f}x t_ref, " if "p50_vs_ref" in pt else ""
        util = "" if pt.get("mfu") is None else f", MFU {pt['mfu']:.1%}"
        parts.append(f"N={pt['tenants']} {vs}{pt['latency_vs_alone']:.2f}x alone "
                     f"({pt['aggregate_tokens_per_s']:.0f} tokens/s{util})")
    if "t_ref_s" in ref:
        util = "" if ref.get("mfu") is None else f", MFU {ref['mfu']:.1%}"
        head = (f"density {result['density']} vs the peft reference (t_ref p50 {ref['t_ref_s']['p50']:.3f} s, "
                f"p90 {ref['t_ref_s']['p90']:.3f} s, {ref['tokens_per_s']:.0f} tokens/s{util}; by p90: "
                f"{result['density_vs_reference']['density_p90']})")
    else:
        head = f"no peft reference ({ref.get('reason', 'not run')})"
    return (f"{head}; density {result['density_vs_one_tenant']} vs one tenant alone; tolerance "
            f"{result['tolerance']:.2f}x, think {result['think_s']:.3f} s: " + ", ".join(parts))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--snapshot", required=True, help="a Hugging Face snapshot folder (config.json, weights)")
    p.add_argument("--has-weights", action="store_true", help="load its weights (else random init from config)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    a = p.parse_args()
    out = measure(a.snapshot, a.has_weights, a.dtype, a.device, a.rank, a.batch, a.seq_len, a.steps, a.warmup)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
