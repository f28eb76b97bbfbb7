"""Megatron-Core switch cost: a GPT under Megatron DDP + DistributedOptimizer, parked every step.

One process, one device (TP=PP=DP=1). Measures, for a bf16 GPT whose state (bf16
params in DDP's param buffer, fp32 grad buffer, fp32 main-param shards, Adam moments)
is a few GB:

* bit-identity: the losses and a checksum of every parameter, main param and optimizer
  state tensor after ``--steps`` steps, unparked (reference) vs tracked by
  ``rota_megatron`` and parked (``gpu.park()``) + restored (``gpu.turn()``) every step;
* device memory after each park (``memory_allocated``, ``memory_reserved``, and the
  device's used memory from ``mem_get_info``, which includes the CUDA context);
* park and restore seconds (from the rota_park/rota_restore hooks, ``gpu.stats``)
  against the pinned floor: the same bytes copied between the same pinned host pool
  and one device buffer, non_blocking on a side stream, one sync (median of 3);
* host pool setup (pinning), off the switch path, reported apart.

    python bench/megatron_switch.py --device cuda --out $OUT/megatron-cuda.json
    python bench/megatron_switch.py --device cpu   # tiny, via rota_megatron.cpu_shim (no GPU)

Needs torch, megatron-core, rota-core, rota-adapter-fsdp and rota-adapter-megatron;
starts an in-process orchestrator on loopback.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from typing import Any

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS: two runs compare bit-for-bit

import torch
import torch.distributed as dist

log = logging.getLogger("megatron_switch")
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hide_broken_tensorboard() -> None:
    """Let megatron-core load where ``torch.utils.tensorboard`` raises something other than ImportError.

    ``megatron.core.timers`` imports tensorboard inside ``except ImportError``. On the
    H200 machine ``bench/device_env.sh`` puts protobuf 5.29.6 (rota's pinned wheel) in
    front of a tensorboard generated for protobuf 6.31, whose import raises
    ``google.protobuf.runtime_version.VersionError`` and took megatron-core down with
    it (2026-11-29). Marking the module absent turns that into the ImportError
    Megatron expects; the bench logs nothing to tensorboard.
    """
    try:
        import torch.utils.tensorboard  # noqa: F401
    except ImportError:
        pass
    except Exception as exc:  # any failure here is the environment's (see docstring), not ours
        log.warning("torch.utils.tensorboard fails to import (%s: %s); hiding it so megatron-core loads",
                    type(exc).__name__, str(exc)[:160])
        sys.modules["torch.utils.tensorboard"] = None  # type: ignore[assignment]


def build(ns: argparse.Namespace, device: torch.device) -> tuple[list[torch.nn.Module], Any]:
    """GPT (local spec, bf16) -> Float16Module -> Megatron DDP; DistributedOptimizer (Adam)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import Float16Module

    cfg = TransformerConfig(num_layers=ns.layers, hidden_size=ns.hidden, num_attention_heads=ns.heads,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0, bf16=True,
                            params_dtype=torch.bfloat16, pipeline_dtype=torch.bfloat16)
    torch.manual_seed(0)
    gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=ns.vocab,
                   max_sequence_length=ns.seq)
    if device.type == "cuda":
        gpt = gpt.cuda(device)
    ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
    chunks: list[torch.nn.Module] = [DistributedDataParallel(cfg, ddp_cfg, Float16Module(cfg, gpt))]
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, bf16=True,
                                                 use_distributed_optimizer=True, clip_grad=1.0), chunks)
    return chunks, opt


def batch(ns: argparse.Namespace, step: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, ns.vocab, (ns.batch, ns.seq), generator=g).to(device)
    position = torch.arange(ns.seq, device=device).expand(ns.batch, ns.seq)
    mask = torch.triu(torch.ones(1, 1, ns.seq, ns.seq, device=device), diagonal=1).bool()
    return tokens, position, mask


def train_step(ns: argparse.Namespace, chunks: list[torch.nn.Module], opt: Any, step: int,
               device: torch.device) -> torch.Tensor:
    return megatron_step(chunks, opt, *batch(ns, step, device))


def megatron_step(chunks: list[torch.nn.Module], opt: Any, tokens: torch.Tensor, position: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    """One Megatron DDP + optimizer step on a batch (also bench/multigpu_switch.py's); the loss, on the host."""
    for c in chunks:
        c.zero_grad_buffer()
    opt.zero_grad()
    loss = sum(c(tokens, position, mask, labels=tokens).float().mean() for c in chunks)
    loss.backward()
    for c in chunks:
        c.finish_grad_sync()
    ok, _, _ = opt.step()
    if not ok:
        raise RuntimeError("optimizer step was skipped")
    return loss.detach().to("cpu", copy=True)


def checksums(chunks: list[torch.nn.Module], opt: Any) -> dict[str, int]:
    """An integer checksum of every parameter, main param and optimizer-state tensor (bit-exact)."""
    from rota_megatron import leaf_optimizers

    named: list[tuple[str, torch.Tensor]] = []
    for i, c in enumerate(chunks):
        named += [(f"chunk{i}.{n}", p) for n, p in c.named_parameters()]
    for k, leaf in enumerate(leaf_optimizers(opt)):
        inner = leaf.optimizer
        for m, p in enumerate(p for g in inner.param_groups for p in g["params"]):
            named.append((f"opt{k}.main{m}", p))
            named += [(f"opt{k}.state{m}.{key}", v) for key, v in inner.state.get(p, {}).items()
                      if isinstance(v, torch.Tensor)]
    out = {}
    for name, t in named:
        t = t.detach().contiguous()
        ints = t.view(INT_VIEW[t.element_size()]).reshape(-1).to(torch.int64)
        out[name] = int((ints * torch.arange(1, ints.numel() + 1, device=ints.device).remainder(1009)).sum())
    return out


def time_floor(pool: Any, nbytes: int, device: torch.device, repeats: int = 3,
               before: Any = None) -> tuple[float, float]:
    """Median seconds of a bare pinned copy of ``nbytes`` device->host and host->device, one sync each.

    ``before``: called right before each timed copy (bench/multigpu_switch.py passes a barrier, so that
    every GPU of a job copies at the same moment).
    """
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pairs, at = [], 0
    for piece in pool.pieces(0, nbytes):
        pairs.append((piece, dev[at:at + piece.numel()]))
        at += piece.numel()
    stream = torch.cuda.Stream(device=device) if device.type == "cuda" else None
    d2h, h2d = [], []
    for _ in range(repeats):
        for out, src_dst in ((d2h, False), (h2d, True)):
            sync(device)
            if before is not None:
                before()
            t0 = time.perf_counter()
            if stream is not None:
                with torch.cuda.stream(stream):
                    for host, d in pairs:
                        (d.copy_(host, non_blocking=True) if src_dst else host.copy_(d, non_blocking=True))
                stream.synchronize()
            else:
                for host, d in pairs:
                    (d.copy_(host) if src_dst else host.copy_(d))
            out.append(time.perf_counter() - t0)
    del dev
    return statistics.median(d2h), statistics.median(h2d)


def memory(device: torch.device) -> dict[str, int]:
    """The allocator's view, the device's used memory (every process), and NVML's bytes of this process."""
    if device.type != "cuda":
        return {}
    from rota_torch import process_device_bytes

    free, total = torch.cuda.mem_get_info(device)
    return {"allocated": torch.cuda.memory_allocated(device), "reserved": torch.cuda.memory_reserved(device),
            "device_used": total - free, "nvml_process": process_device_bytes(device) or 0}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out")
    ns = p.parse_args()
    big = ns.device == "cuda"
    for k, cuda_v, cpu_v in (("hidden", 2048, 64), ("layers", 4, 2), ("heads", 16, 4), ("vocab", 32768, 128),
                             ("seq", 512, 32)):
        if getattr(ns, k) is None:
            setattr(ns, k, cuda_v if big else cpu_v)
    out_path = ns.out or f"bench/results/megatron-{ns.device}.json"
    logging.basicConfig(level=logging.INFO, format="[megatron_switch %(asctime)s] %(message)s")
    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)) if big else 1)
    hide_broken_tensorboard()

    from rota.testing import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if big:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if big else "gloo", rank=0, world_size=1)
    if big:
        torch.use_deterministic_algorithms(True, warn_only=True)
        device = torch.device("cuda", 0)
    else:
        from rota_megatron import cpu_shim

        cpu_shim.install()
        device = torch.device("cpu")
    from megatron.core import parallel_state

    import rota
    import rota_megatron

    parallel_state.initialize_model_parallel(1, 1)
    if big:  # Megatron's layers fork the model-parallel CUDA RNG; it must be seeded first
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    name = torch.cuda.get_device_name(device) if big else platform.processor() or platform.machine()
    log.info("device %s (%s), torch %s, megatron-core %s", device, name, torch.__version__,
             rota_megatron.MEGATRON_VERSION)
    mem_empty = memory(device)

    chunks, opt = build(ns, device)
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    ref_losses = [train_step(ns, chunks, opt, i, device) for i in range(ns.steps)]
    ref_sums = checksums(chunks, opt)
    mem_trained = memory(device)
    del chunks, opt
    gc.collect()
    if big:
        torch.cuda.empty_cache()
    mem_after_ref = memory(device)
    log.info("reference: %d params, losses %s", n_params, [f"{float(x):.5f}" for x in ref_losses])

    from rota.testing import running_orchestrator

    with running_orchestrator() as (endpoint, _engine):
        gpu = rota.connect(group="bench", tenant="megatron", endpoint=endpoint)
        chunks, opt = build(ns, device)
        tracked = rota_megatron.track(gpu, chunks, opt)
        pool_s = tracked.prepare()
        losses, parks, mem_parked = [], [], []
        for i in range(ns.steps):
            with gpu.turn():
                losses.append(train_step(ns, chunks, opt, i, device))
            res = gpu.park()
            parks.append(res)
            mem_parked.append(memory(device))
            log.info("step %d: loss %.5f, parked %.3f GB in %.4f s, device memory %s", i, float(losses[-1]),
                     res.bytes_moved / 1e9, res.seconds, mem_parked[-1])
        restores = list(gpu.stats.restores)
        failed = gpu.stats.failed("park") + gpu.stats.failed("restore")
        with gpu.turn():
            sums = checksums(chunks, opt)
            state_bytes = sum(parks[-1].by_tag.values())
            floor_d2h, floor_h2d = time_floor(tracked.parker.pool, state_bytes, device)
        footprint = tracked.footprint()
        allocations = tracked.parker.pool.allocations
        tracked.untrack()
        gpu.close()

    # The first park after step 0 is the one that sees state the pool was sized for; report steady state too.
    park_s = [r.seconds for r in parks]
    restore_s = [r.seconds for r in restores]
    mismatched = sorted(k for k in ref_sums if sums.get(k) != ref_sums[k])
    result = {
        "bench": "megatron_switch", "device": str(device), "device_name": name, "torch": torch.__version__,
        "megatron_core": rota_megatron.MEGATRON_VERSION, "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "model": {"hidden": ns.hidden, "layers": ns.layers, "heads": ns.heads, "vocab": ns.vocab, "seq": ns.seq,
                  "batch": ns.batch, "params": n_params, "dtype": "bf16", "ddp": "megatron DDP, fp32 grad buffer",
                  "optimizer": "DistributedOptimizer(Adam), fp32 main params", "tp": 1, "pp": 1, "dp": 1},
        "steps": ns.steps,
        "state_bytes": state_bytes, "by_tag": parks[-1].by_tag, "footprint": footprint,
        "losses_bit_identical": all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)),
        "state_bit_identical": not mismatched and sums.keys() == ref_sums.keys(),
        "state_tensors_compared": len(ref_sums), "state_mismatched": mismatched[:20],
        "ref_losses": [float(x) for x in ref_losses], "losses": [float(x) for x in losses],
        "memory": {"empty": mem_empty, "reference_trained": mem_trained, "after_reference_freed": mem_after_ref,
                   "after_park": mem_parked},
        "park_s": park_s, "restore_s": restore_s,
        "park_s_median": statistics.median(park_s), "restore_s_median": statistics.median(restore_s) if restore_s
        else None,
        "floor_d2h_s": floor_d2h, "floor_h2d_s": floor_h2d,
        "park_vs_floor": statistics.median(park_s) / floor_d2h,
        "restore_vs_floor": statistics.median(restore_s) / floor_h2d if restore_s else None,
        "park_gbps": state_bytes / statistics.median(park_s) / 1e9,
        "floor_d2h_gbps": state_bytes / floor_d2h / 1e9, "floor_h2d_gbps": state_bytes / floor_h2d / 1e9,
        "pool_setup_s": pool_s, "pool_allocations": allocations, "failed": failed,
    }
    if restore_s:
        result["restore_gbps"] = state_bytes / statistics.median(restore_s) / 1e9
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=2)
    log.info("bit-identical losses %s, state %s; %.3f GB parked in %.4f s (floor %.4f s), restored in %s s "
             "(floor %.4f s); after park %s; wrote %s", result["losses_bit_identical"],
             result["state_bit_identical"], state_bytes / 1e9, result["park_s_median"], floor_d2h,
             result["restore_s_median"], floor_h2d, mem_parked[-1], out_path)
    dist.destroy_process_group()
    if failed or not (result["losses_bit_identical"] and result["state_bit_identical"]):
        sys.exit(f"megatron_switch: {failed} failed park(s)/restore(s), bit-identical losses "
                 f"{result['losses_bit_identical']}, state {result['state_bit_identical']}; see {out_path}")


if __name__ == "__main__":
    main()
