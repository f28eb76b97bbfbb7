"""Multi-rank tenants over NCCL: two jobs of W ranks (one rank per GPU) take turns on W GPUs.

Each job is one rota tenant of one group that spans the GPUs; all of its ranks acquire,
park and restore as one unit. The orchestrator runs without a capacity, so every switch
parks the job that held the group (on every GPU at once) and restores the other. Measured
per rank, in one run:

* park and restore seconds of every switch, against the pinned floor of that rank's GPU:
  the same bytes copied between the tenant's own pinned host pool and a device buffer,
  device->host and host->device, with every GPU of the job copying at the same moment
  (a barrier before each copy), median of 3;
* what each park left on the device, by category: tracked tags, named untracked tensors,
  the allocator's totals, and NVML's bytes outside torch's allocator (CUDA context, NCCL),
  with NCCL's own share measured when the communicator is created (NVML before and after
  the first collective); whether that stayed flat across parks (communicators are never
  re-created by a turn);
* bit-identity: each rank's losses and a checksum of its final state against the same
  job trained without rota in the same process before the turns start;
* no hang: every rank must finish within ``--timeout``.

Frameworks: ``fsdp2`` (``fully_shard`` per layer + root, AdamW, fp32) and ``megatron``
(GPTModel, Megatron DDP + DistributedOptimizer, bf16 with fp32 main params, tensor
parallel across the ranks: TP = W, or DP = W with ``--megatron-dp``).

    python bench/multigpu_switch.py --framework fsdp2 --device cuda --turns 50 \\
        --out bench/results/multigpu-fsdp2-cuda.json
    python bench/multigpu_switch.py --framework megatron --device cuda --turns 50
    python bench/multigpu_switch.py --framework fsdp2 --device cpu --turns 4   # gloo, tiny

Needs torch, rota-core, rota-adapter-fsdp (and rota-adapter-megatron + megatron-core for
``megatron``); starts its own orchestrator on loopback.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

log = logging.getLogger("multigpu_switch")
HERE = os.path.abspath(__file__)


# --------------------------------------------------------------------------- worker


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _nvml(device: Any) -> int | None:
    from rota_torch import process_device_bytes

    return process_device_bytes(device)


def _checksum(tensors: list[Any]) -> int:
    """A position-weighted integer sum over the raw bytes of ``tensors``: equal iff (practically) bit-equal."""
    import torch

    total = 0
    for t in tensors:
        words = t.detach().contiguous().reshape(-1).view(torch.uint8).to(torch.int64)
        weights = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.int64).remainder(1009)
        total = (total * 1_000_003 + int((words * weights).sum())) % (1 << 61)
    return total


class Fsdp2:
    """``fully_shard`` MLP stack: per-layer units plus the root, AdamW, fp32."""

    def __init__(self, ns: argparse.Namespace, device: Any, world: int) -> None:
        import torch

        self.ns, self.device, self.world = ns, device, world
        params = ns.state_bytes * world / 16  # weights + grads + two AdamW moments, fp32, sharded W ways
        self.hidden = max(64, int((params / ns.layers) ** 0.5) // 64 * 64)
        self.dtype = torch.float32

    def build(self) -> tuple[Any, Any]:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(0)
        with torch.device(self.device):
            model = torch.nn.Sequential(*[torch.nn.Linear(self.hidden, self.hidden) for _ in range(self.ns.layers)])
        mesh = init_device_mesh(self.device.type, (self.world,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        return model, opt

    def step(self, model: Any, opt: Any, i: int, rank: int) -> Any:
        import torch

        g = torch.Generator(device=self.device).manual_seed(1000 * rank + i)
        x = torch.randn(self.ns.batch, self.hidden, device=self.device, generator=g)
        h = x
        for layer in model:
            h = torch.tanh(layer(h))
        loss = torch.nn.functional.mse_loss(h, x)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return loss.detach().to("cpu", copy=True)

    def track(self, gpu: Any, model: Any, opt: Any) -> Any:
        import rota_fsdp

        return rota_fsdp.track(gpu, model, opt)

    def state(self, model: Any, opt: Any) -> list[Any]:
        out = [getattr(p, "_local_tensor", p) for p in model.parameters()]
        for s in opt.state.values():
            out += [getattr(v, "_local_tensor", v) for v in s.values() if hasattr(v, "dim") and v.dim() > 0]
        return out

    def describe(self) -> dict[str, Any]:
        return {"framework": "fsdp2", "hidden": self.hidden, "layers": self.ns.layers, "batch": self.ns.batch,
                "dtype": "float32", "optimizer": "AdamW",
                "sharding": f"fully_shard per layer + root, {self.world} ways"}


class Megatron:
    """GPTModel under Megatron DDP + DistributedOptimizer (Adam), bf16 with fp32 main params."""

    def __init__(self, ns: argparse.Namespace, device: Any, world: int) -> None:
        self.ns, self.device, self.world = ns, device, world
        self.tp = 1 if ns.megatron_dp else world

    def setup(self) -> None:
        import warnings

        warnings.filterwarnings("ignore")
        sys.path.insert(0, os.path.dirname(HERE))
        from megatron_switch import hide_broken_tensorboard

        hide_broken_tensorboard()
        if self.device.type == "cpu":
            from rota_megatron import cpu_shim

            cpu_shim.install()
        from megatron.core import parallel_state

        parallel_state.initialize_model_parallel(tensor_model_parallel_size=self.tp)
        if self.device.type == "cuda":
            from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(0)

    def build(self) -> tuple[Any, Any]:
        import torch
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer import TransformerConfig
        from megatron.core.transformer.module import Float16Module

        ns = self.ns
        bf16 = self.device.type == "cuda"
        dtype = torch.bfloat16 if bf16 else torch.float32
        cfg = TransformerConfig(num_layers=ns.layers, hidden_size=ns.hidden, num_attention_heads=ns.heads,
                                tensor_model_parallel_size=self.tp, use_cpu_initialization=True, hidden_dropout=0.0,
                                attention_dropout=0.0, bf16=bf16, params_dtype=dtype, pipeline_dtype=dtype)
        torch.manual_seed(0)
        gpt = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=ns.vocab,
                       max_sequence_length=ns.seq)
        if self.device.type == "cuda":
            gpt = gpt.cuda(self.device)
        inner = Float16Module(cfg, gpt) if bf16 else gpt
        ddp_cfg = DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=True)
        chunks = [DistributedDataParallel(cfg, ddp_cfg, inner)]
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, weight_decay=0.01, bf16=bf16,
                                                     use_distributed_optimizer=True, clip_grad=1.0), chunks)
        return chunks, opt

    def step(self, chunks: Any, opt: Any, i: int, rank: int) -> Any:
        import torch

        ns = self.ns
        data_rank = 0 if self.tp > 1 else rank  # tensor-parallel ranks see the same batch
        g = torch.Generator().manual_seed(1000 * data_rank + i)
        tokens = torch.randint(0, ns.vocab, (ns.batch, ns.seq), generator=g).to(self.device)
        position = torch.arange(ns.seq, device=self.device).expand(ns.batch, ns.seq)
        mask = torch.triu(torch.ones(1, 1, ns.seq, ns.seq, device=self.device), diagonal=1).bool()
        from megatron_switch import megatron_step  # bench/ is on sys.path since setup()

        return megatron_step(chunks, opt, tokens, position, mask)

    def track(self, gpu: Any, chunks: Any, opt: Any) -> Any:
        import rota_megatron

        return rota_megatron.track(gpu, chunks, opt)

    def state(self, chunks: Any, opt: Any) -> list[Any]:
        import torch

        from rota_megatron import leaf_optimizers

        out = [p for c in chunks for p in c.parameters()]
        for leaf in leaf_optimizers(opt):
            inner = leaf if isinstance(leaf, torch.optim.Optimizer) else leaf.optimizer
            mains = [p for g in inner.param_groups for p in g["params"]]
            out += mains + [v for m in mains for v in inner.state.get(m, {}).values()
                            if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    def describe(self) -> dict[str, Any]:
        ns = self.ns
        return {"framework": "megatron", "hidden": ns.hidden, "layers": ns.layers, "heads": ns.heads,
                "vocab": ns.vocab, "seq": ns.seq, "batch": ns.batch, "tp": self.tp, "dp": self.world // self.tp,
                "dtype": "bf16 params, fp32 grads and main params" if self.device.type == "cuda" else "float32",
                "optimizer": "DistributedOptimizer(Adam)"}


def _floor(pool: Any, nbytes: int, device: Any) -> tuple[float, float]:
    """Median seconds of a pinned copy of ``nbytes`` D2H and H2D, every rank of the job starting together."""
    import torch.distributed as dist

    sys.path.insert(0, os.path.dirname(HERE))
    from megatron_switch import time_floor  # the same floor as the one-GPU Megatron bench

    return time_floor(pool, nbytes, device, before=dist.barrier)


def worker(ns: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, world = ns.rank, ns.world
    logging.basicConfig(level=logging.INFO, format=f"[{ns.job} rank {rank} %(asctime)s] %(message)s")
    cuda = ns.device == "cuda"
    torch.set_num_threads(2 if cuda else 1)
    if cuda:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.zeros(1, device=device)  # the CUDA context, before any communicator
    else:
        device = torch.device("cpu")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ns.port))
    context_bytes = _nvml(device) if cuda else None
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world,
                            device_id=device if cuda else None)
    dist.barrier()  # creates the communicator
    _sync(device)
    after_comm = _nvml(device) if cuda else None
    nccl_bytes = (after_comm - context_bytes - torch.cuda.memory_reserved(device)) \
        if context_bytes is not None and after_comm is not None else None

    fw: Any = Fsdp2(ns, device, world) if ns.framework == "fsdp2" else Megatron(ns, device, world)
    if hasattr(fw, "setup"):
        fw.setup()

    model, opt = fw.build()
    t0 = time.perf_counter()
    ref_losses = [fw.step(model, opt, i, rank) for i in range(ns.turns)]
    _sync(device)
    ref_seconds = time.perf_counter() - t0
    ref_sum = _checksum(fw.state(model, opt))
    del model, opt
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    import rota

    gpu = rota.connect(group="gpus", tenant=ns.job, endpoint=ns.endpoint)
    if (gpu.rank, gpu.world_size) != (rank, world):
        raise RuntimeError(f"rota.connect saw rank {gpu.rank}/{gpu.world_size}, expected {rank}/{world}")
    model, opt = fw.build()
    tracked = fw.track(gpu, model, opt)
    pool_s = tracked.prepare()
    print("READY", flush=True)
    if sys.stdin.readline().strip() != "GO":
        raise SystemExit("no GO from the bench")
    losses, outside = [], []
    start = time.monotonic()
    for i in range(ns.turns):
        with gpu.turn():
            losses.append(fw.step(model, opt, i, rank))
    with gpu.turn():
        state_sum = _checksum(fw.state(model, opt))
        state_bytes = sum(tracked.footprint().values())
        floor_d2h, floor_h2d = _floor(tracked.parker.pool, state_bytes, device)
    wall = time.monotonic() - start
    parks = [(p.bytes_moved, p.seconds) for p in gpu.stats.parks]
    restores = [(r.bytes_moved, r.seconds) for r in gpu.stats.restores]
    res_list = [dict(p.residue) for p in gpu.stats.parks]
    for r in res_list:
        if "process:outside_allocator" in r:
            outside.append(r["process:outside_allocator"])
    out = {
        "job": ns.job, "rank": rank, "device": str(device), "model": fw.describe(), "state_bytes": state_bytes,
        "footprint": tracked.footprint(), "pool_setup_s": pool_s, "reference_seconds": ref_seconds,
        "turns_wall_s": wall, "turns": gpu.stats.turns,
        "losses_bit_identical": len(losses) == len(ref_losses) and all(
            torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True)),
        "state_bit_identical": state_sum == ref_sum,
        "losses": [float(x) for x in losses], "reference_losses": [float(x) for x in ref_losses],
        "parks": parks, "restores": restores, "residues": res_list,
        "floor_d2h_s": floor_d2h, "floor_h2d_s": floor_h2d,
        "nvml_context_bytes": context_bytes, "nccl_communicator_bytes": nccl_bytes,
        "outside_allocator_at_parks": outside,
        "communicators_kept": bool(outside) and max(outside) - min(outside) < 64 << 20,
        "waits_ms": list(gpu.stats.waits_ms),
    }
    with open(ns.out, "w") as f:
        json.dump(out, f)
    tracked.untrack()
    gpu.close()
    dist.destroy_process_group()


# --------------------------------------------------------------------------- bench


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _rank_summary(r: dict[str, Any]) -> dict[str, Any]:
    """One rank's switch costs against its floor, and its residue by category."""
    park = _median([s for _, s in r["parks"]])
    restore = _median([s for _, s in r["restores"]])
    res = r["residues"]

    def cat(pred: Any) -> int:
        return max((sum(v for k, v in x.items() if pred(k)) for x in res), default=0)

    return {
        "job": r["job"], "rank": r["rank"], "device": r["device"], "state_gb": r["state_bytes"] / 1e9,
        "parks": len(r["parks"]), "restores": len(r["restores"]),
        "park_s_median": park, "restore_s_median": restore,
        "floor_d2h_s": r["floor_d2h_s"], "floor_h2d_s": r["floor_h2d_s"],
        "park_vs_floor": park / r["floor_d2h_s"] if park else None,
        "restore_vs_floor": restore / r["floor_h2d_s"] if restore else None,
        "residue_max_bytes": {
            "tracked_tags": cat(lambda k: ":" not in k),
            "untracked_named": cat(lambda k: k.startswith("untracked:")),
            "allocator_allocated": cat(lambda k: k == "process:allocated"),
            "allocator_reserved": cat(lambda k: k == "process:reserved"),
            "outside_allocator_nvml": cat(lambda k: k == "process:outside_allocator"),
            "outside_allocator_growth_since_track": cat(lambda k: k == "process:outside_allocator_growth"),
        },
        "untracked_names": sorted({k for x in res for k in x if k.startswith("untracked:")})[:10],
        "nccl_communicator_bytes": r["nccl_communicator_bytes"], "nvml_context_bytes": r["nvml_context_bytes"],
        "communicators_kept": r["communicators_kept"],
        "losses_bit_identical": r["losses_bit_identical"], "state_bit_identical": r["state_bit_identical"],
    }


def bench(ns: argparse.Namespace) -> dict[str, Any]:
    import torch

    from rota.orchestrator import OrchestratorConfig
    from rota.testing import free_port, running_orchestrator

    world = ns.world or (torch.cuda.device_count() if ns.device == "cuda" else 2)
    if ns.device == "cuda" and torch.cuda.device_count() < world:
        raise SystemExit(f"--world {world} needs {world} GPUs; this machine has {torch.cuda.device_count()}")
    tmp = ns.tmp or tempfile.mkdtemp(prefix="rota-multigpu-")
    os.makedirs(tmp, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROTA_")}
    env.update(PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", OMP_NUM_THREADS="2", CUBLAS_WORKSPACE_CONFIG=":4096:8")
    config = OrchestratorConfig(ttl_s=30.0, park_timeout_s=300.0)  # no capacity: every switch parks
    jobs = [f"job{j}" for j in range(ns.jobs)]
    with running_orchestrator(config) as (endpoint, engine):
        procs: list[tuple[str, int, subprocess.Popen, str, Any]] = []
        for job in jobs:
            port = free_port()
            for rank in range(world):
                out = os.path.join(tmp, f"{job}-rank{rank}.json")
                logf = open(os.path.join(tmp, f"{job}-rank{rank}.log"), "w")
                cmd = [sys.executable, HERE, "--worker", "--framework", ns.framework, "--device", ns.device,
                       "--job", job, "--rank", str(rank), "--world", str(world), "--port", str(port),
                       "--endpoint", endpoint, "--turns", str(ns.turns), "--state-bytes", str(ns.state_bytes),
                       "--layers", str(ns.layers), "--hidden", str(ns.hidden), "--heads", str(ns.heads),
                       "--vocab", str(ns.vocab), "--seq", str(ns.seq), "--batch", str(ns.batch), "--out", out]
                if ns.megatron_dp:
                    cmd.append("--megatron-dp")
                p = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=logf,
                                     text=True)
                procs.append((job, rank, p, out, logf))
        deadline = time.monotonic() + ns.timeout
        try:
            for job, rank, p, _, _ in procs:
                line = p.stdout.readline()
                if line.strip() != "READY":
                    raise RuntimeError(f"{job} rank {rank} did not get ready (exit {p.poll()}); see {tmp}")
            log.info("all %d ranks ready (reference runs done); go", len(procs))
            t0 = time.monotonic()
            for _, _, p, _, _ in procs:
                p.stdin.write("GO\n")
                p.stdin.flush()
            hung = []
            for job, rank, p, _, _ in procs:
                try:
                    p.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    hung.append(f"{job}/rank{rank}")
            makespan = time.monotonic() - t0
        finally:
            for _, _, p, _, logf in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                logf.close()
        failed = [f"{j}/rank{r} exit {p.returncode}" for j, r, p, _, _ in procs if p.returncode]
        if failed:
            tail = open(os.path.join(tmp, f"{procs[0][0]}-rank0.log")).read()[-2000:]
            raise RuntimeError(f"ranks failed: {failed} (hung: {hung}); logs in {tmp}; first log ends:\n{tail}")
        group = engine.groups["gpus"]
        switches, busy = group.switches, group.busy_seconds
    ranks = [json.load(open(out)) for _, _, _, out, _ in procs]
    summary = [_rank_summary(r) for r in ranks]
    return {
        "bench": "multigpu_switch", "framework": ns.framework, "device": ns.device,
        "device_name": torch.cuda.get_device_name(0) if ns.device == "cuda" else platform.machine(),
        "gpus": world if ns.device == "cuda" else 0, "torch": torch.__version__, "python": platform.python_version(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "jobs": len(jobs), "ranks_per_job": world,
        "turns_per_job": ns.turns, "model": ranks[0]["model"],
        "how": ("one rota group spans the GPUs; each job is one tenant whose ranks act as a unit; no capacity, "
                "so every switch parks the previous job on every GPU and restores the next; floors are the "
                "tenant's own pinned pool <-> one device buffer, every GPU of the job copying at once"),
        "makespan_s": makespan, "switches": switches, "group_busy_seconds": busy, "hung": hung,
        "all_bit_identical": all(s["losses_bit_identical"] and s["state_bit_identical"] for s in summary),
        "ranks": summary, "raw": ranks,
    }


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['framework']} on {result['device_name']}: {result['jobs']} jobs x {result['ranks_per_job']} "
             f"ranks, {result['turns_per_job']} turns each, {result['switches']} switches, makespan "
             f"{result['makespan_s']:.1f} s, bit-identical: {result['all_bit_identical']}, hung: "
             f"{result['hung'] or 'none'}",
             f"{'job/rank':<12} {'state':>8} {'park':>9} {'floor':>9} {'ratio':>6} {'restore':>9} {'floor':>9} "
             f"{'ratio':>6} {'alloc left':>11} {'outside':>9} {'nccl':>8}"]
    for s in result["ranks"]:
        def t(x: float | None) -> str:
            return f"{x:.4f}s" if x is not None else "-"

        def r(x: float | None) -> str:
            return f"{x:.2f}x" if x is not None else "-"

        res = s["residue_max_bytes"]
        nccl = s["nccl_communicator_bytes"]
        lines.append(f"{s['job'] + '/' + str(s['rank']):<12} {s['state_gb']:>6.2f}GB {t(s['park_s_median']):>9} "
                     f"{t(s['floor_d2h_s']):>9} {r(s['park_vs_floor']):>6} {t(s['restore_s_median']):>9} "
                     f"{t(s['floor_h2d_s']):>9} {r(s['restore_vs_floor']):>6} "
                     f"{res['allocator_allocated'] / 2**20:>8.1f}MiB "
                     f"{res['outside_allocator_nvml'] / 2**20:>6.0f}MiB "
                     f"{(nccl or 0) / 2**20:>5.0f}MiB")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--framework", choices=["fsdp2", "megatron"], default="fsdp2")
    p.add_argument("--device", choices=["cuda", "cpu"], default=None)
    p.add_argument("--world", type=int, default=0, help="ranks (= GPUs) per job; default: every GPU (cpu: 2)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--turns", type=int, default=50)
    p.add_argument("--state-bytes", type=float, default=None, help="fsdp2: state per rank (default 4.3e9; cpu 2e6)")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--megatron-dp", action="store_true", help="megatron: data parallel across the ranks, not TP")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks count as hung")
    p.add_argument("--out", default=None)
    p.add_argument("--tmp", default=None, help="where each rank's log and result go (default: a new temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    for name in ("job", "rank", "port", "endpoint"):
        p.add_argument(f"--{name}", help=argparse.SUPPRESS)
    ns = p.parse_args()
    if ns.device is None:
        import torch

        ns.device = "cuda" if torch.cuda.is_available() else "cpu"
    big = ns.device == "cuda"
    fsdp = ns.framework == "fsdp2"
    defaults = {"layers": (8, 2), "hidden": (0, 0) if fsdp else (2048, 64), "heads": (16, 4),
                "vocab": (32768, 128), "seq": (512, 32), "batch": (64, 8) if fsdp else (4, 2),
                "state_bytes": (4.3e9, 2e6)}
    for k, (cuda_v, cpu_v) in defaults.items():
        if getattr(ns, k) is None:
            setattr(ns, k, cuda_v if big else cpu_v)
    ns.state_bytes = int(ns.state_bytes)
    if ns.worker:
        ns.rank, ns.port = int(ns.rank), int(ns.port)
        worker(ns)
        return
    logging.basicConfig(level=logging.INFO, format="[multigpu_switch %(asctime)s] %(message)s")
    ns.out = ns.out or f"bench/results/multigpu-{ns.framework}-{ns.device}.json"
    result = bench(ns)
    os.makedirs(os.path.dirname(os.path.abspath(ns.out)), exist_ok=True)
    with open(ns.out, "w") as f:
        json.dump(result, f, indent=2)
    print(table(result))
    print(f"wrote {ns.out}")


if __name__ == "__main__":
    main()
