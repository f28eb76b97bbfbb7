"""Tenant density of rota-service-tinker: N LoRA tenants sharing one resident base model on one device.

Each tenant is a real ``tinker`` SDK client (its own API key, its own trainer worker
process) running a steady loop: ``forward_backward`` + ``optim_step`` (one *step*), then
``think`` seconds off the device (what an RL tenant spends on rollouts, environment
steps and reward scoring), then the next step. All tenants' LoRA models sit on one base
model that is resident **once** on the device (the service's base holder; tenants get it
through CUDA IPC, or shared memory on CPU); only each tenant's adapter and Adam state
move between turns. Every work unit is a rota turn on the device's group.

Definition (also written into the JSON as ``definition``):

* *per-step latency* of a tenant: wall time from sending ``forward_backward`` to having
  both its result and ``optim_step``'s; a point's latency is the median over all tenants'
  measured steps (after ``--warmup``).
* *baseline*: N = 1, one tenant alone on the device (one tenant per GPU).
* *density*: the largest tested N such that, for it and every smaller tested N, the
  point's latency is at most ``--tolerance`` x the baseline latency.
* *think time*: ``--think-s`` seconds, or (default) ``--think-ratio`` x the baseline's
  back-to-back step time, measured in a calibration phase of the N = 1 point. With
  ratio r a tenant alone keeps the device busy 1/(1+r) of the time; the ideal density
  is about 1+r, and what rota's switching costs shows up as the gap.
* *aggregate throughput*: measured steps of all tenants / the span they were measured
  in (steps/s and tokens/s).
* *memory*: on CUDA, device memory in use (``nvidia-smi``) at its peak during the
  point minus before the service started; on CPU, the summed PSS of the base holder and
  the trainer workers. ``--unshared N`` adds one point with base sharing off (every
  tenant's worker loads its own base): the difference to the shared point of the same
  N is the memory sharing saves (about (N-1) x ``base_bytes`` if CUDA IPC shares it).

    # H200 (about 3 minutes): a 2.1 GB fp32 base, 1/2/4/8 tenants, one unshared point
    python bench/tinker_density.py --device cuda:0 --tenants 1,2,4,8 --unshared 2 \\
        --out bench/results/tinker-density-h200.json
    # CPU smoke run (under a minute)
    python bench/tinker_density.py --device cpu --vocab 256 --dim 64 --layers 2 --heads 2 --batch 2 \\
        --seq-len 16 --tenants 1,2 --steps 3 --warmup 1 --unshared 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

log = logging.getLogger("tinker_density")

DEFINITION = ("density = largest tested N such that, for it and every smaller tested N, the median per-step latency "
              "(forward_backward+optim_step, all tenants' measured steps) is <= tolerance x the N=1 median (one "
              "tenant per device); every tenant thinks think_s seconds off-device between steps; all N LoRA tenants "
              "share one resident base (unless share_lora_base is false)")


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


def _gpu_index(device: str) -> int | None:
    m = re.match(r"^cuda(?::(\d+))?$", device)
    return None if m is None else int(m.group(1) or 0)


def _device_used(device: str) -> int | None:
    """Device memory in use (bytes, whole device, from nvidia-smi); None on CPU or without nvidia-smi."""
    idx = _gpu_index(device)
    if idx is None or shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", f"--id={idx}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30)
    return int(out.stdout.strip().splitlines()[0]) * 2**20 if out.returncode == 0 and out.stdout.strip() else None


def _pss(pids: list[int]) -> int:
    """Summed proportional set size (bytes) of ``pids``: shared pages count once across them."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
    return total


class _Peak:
    """Polls device memory in a thread; ``peak`` is the highest reading."""

    def __init__(self, device: str, every_s: float = 0.5) -> None:
        self.device, self.every_s, self.peak = device, every_s, None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            used = _device_used(self.device)
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)
            self._stop.wait(self.every_s)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def run_point(n: int, args: argparse.Namespace, think_s: float | None, share: bool = True) -> dict:
    """N tenants concurrently; think_s None: calibrate it first (N = 1 only). Latencies, throughput, memory."""
    import tinker
    from tinker import types

    from rota.testing import running_orchestrator
    from rota_tinker import BaseModelSpec, ServiceConfig, Tenant, TinkerService

    spec = BaseModelSpec("bench/lm", vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                         max_len=max(256, args.seq_len), seed=0)
    tenants = tuple(Tenant(f"t{i}", f"tml-bench-tenant-{i:04d}") for i in range(n))
    idle = _device_used(args.device)
    data = _batch(spec.vocab, args.seq_len, args.batch, seed=0)
    with running_orchestrator() as (endpoint, _engine):
        config = ServiceConfig(tenants=tenants, data_dir=tempfile.mkdtemp(prefix="tinker-density-"),
                               device=args.device, group=f"density-{n}-{int(share)}", endpoint=endpoint,
                               long_poll_s=5.0, base_models={spec.name: spec}, share_lora_base=share,
                               worker_start_timeout_s=300.0)
        with TinkerService(config) as svc, _Peak(args.device) as peak:
            t_start = time.perf_counter()
            clients = [tinker.ServiceClient(base_url=svc.url, api_key=t.api_key) for t in tenants]
            trainers: list = [None] * n
            errors: list[BaseException] = []

            def create(i: int) -> None:
                try:
                    trainers[i] = clients[i].create_lora_training_client(base_model=spec.name, rank=args.rank,
                                                                         seed=i).result(600)
                except BaseException as e:
                    errors.append(e)

            _in_threads(create, n)
            if errors:
                raise errors[0]
            start_s = time.perf_counter() - t_start
            lat: dict[str, list[float]] = {t.name: [] for t in tenants}
            spans: list[tuple[float, float]] = []
            think = [think_s]
            calibrated = threading.Event()
            if think_s is not None:
                calibrated.set()
            barrier = threading.Barrier(n)

            def step(tc: object) -> float:
                t0 = time.perf_counter()
                fb = tc.forward_backward(data, "cross_entropy")  # type: ignore[attr-defined]
                op = tc.optim_step(types.AdamParams(learning_rate=1e-4))  # type: ignore[attr-defined]
                fb.result(600)
                op.result(600)
                return time.perf_counter() - t0

            def loop(i: int) -> None:
                try:
                    tc, name = trainers[i], tenants[i].name
                    barrier.wait(600)
                    for _ in range(args.warmup):
                        step(tc)
                    if not calibrated.is_set():  # N = 1 only: back-to-back steps set the think time
                        back_to_back = statistics.median(step(tc) for _ in range(3))
                        think[0] = args.think_ratio * back_to_back
                        calibrated.set()
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        lat[name].append(step(tc))
                        spans.append((t0, time.perf_counter()))
                        time.sleep(think[0])
                except BaseException as e:
                    errors.append(e)

            _in_threads(loop, n)
            if errors:
                raise errors[0]
            holder = svc.base_holder_info(spec.name) if share else None
            pids = [svc.worker_pid(t.name, "trainer") for t in tenants] + ([holder["pid"]] if holder else [])
            host_pss = _pss([p for p in pids if p is not None])
    every = [x for v in lat.values() for x in v]
    window = max(e for _, e in spans) - min(s for s, _ in spans)
    steps = len(every)
    base_bytes = sum(p.numel() for p in _param_shapes(spec)) * 4
    return {"tenants": n, "share_lora_base": share, "think_s": think[0], "median_step_s": statistics.median(every),
            "p90_step_s": float(np.percentile(every, 90)),
            "per_tenant_median_s": {k: statistics.median(v) for k, v in lat.items()},
            "aggregate_steps_per_s": steps / window,
            "aggregate_tokens_per_s": steps * args.batch * args.seq_len / window,
            "worker_start_s": start_s, "base_bytes": base_bytes,
            "holder_bytes": holder["bytes"] if holder else None,
            "device_mem_idle_bytes": idle, "device_mem_peak_bytes": peak.peak,
            "device_mem_used_bytes": (peak.peak - idle) if peak.peak is not None and idle is not None else None,
            "host_pss_bytes": host_pss}


def _param_shapes(spec: object) -> list:
    """The base's parameters on ``meta`` (sizes only, nothing allocated): for base_bytes."""
    import torch

    from rota_tinker._models import TinyLM

    with torch.device("meta"):
        return list(TinyLM(spec).parameters())  # type: ignore[arg-type]


def _in_threads(fn: object, n: int) -> None:
    threads = [threading.Thread(target=fn, args=(i,)) for i in range(n)]  # type: ignore[arg-type]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3600)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0", help="cpu, cuda or cuda:N (every worker and the base holder)")
    p.add_argument("--vocab", type=int, default=32000, help="base model: vocabulary size")
    p.add_argument("--dim", type=int, default=2048, help="base model: width")
    p.add_argument("--layers", type=int, default=8, help="base model: transformer blocks")
    p.add_argument("--heads", type=int, default=16, help="base model: attention heads")
    p.add_argument("--tenants", default="1,2,4,8", help="comma-separated N values (1 is always run: the baseline)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of every tenant")
    p.add_argument("--batch", type=int, default=8, help="sequences per forward_backward")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="measured steps per tenant")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per tenant first")
    p.add_argument("--think-s", type=float, default=None, help="seconds off-device between a tenant's steps")
    p.add_argument("--think-ratio", type=float, default=4.0,
                   help="without --think-s: think time = this x the one-tenant back-to-back step time")
    p.add_argument("--tolerance", type=float, default=1.25, help="'equal latency' = within this factor of N=1")
    p.add_argument("--unshared", type=int, default=0, help="also run this N with base sharing off (0: skip)")
    p.add_argument("--out", default="", help="write the JSON here too")
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("ROTA_LOG_LEVEL", "WARNING"))
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    try:
        ns = sorted({1} | {int(x) for x in args.tenants.split(",") if x.strip()})
    except ValueError:
        p.error(f"--tenants {args.tenants!r} must be comma-separated integers")
    if ns[0] < 1:
        p.error(f"--tenants {args.tenants!r} needs positive integers")
    for name in ("vocab", "dim", "layers", "heads", "rank", "batch", "seq_len", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if args.warmup < 0 or args.unshared < 0:
        p.error("--warmup and --unshared must be >= 0")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.rank > args.dim:
        p.error(f"--rank {args.rank} must be <= --dim {args.dim}")
    if (args.think_s is not None and args.think_s < 0) or args.think_ratio < 0:
        p.error("--think-s and --think-ratio must be >= 0")
    if args.tolerance < 1:
        p.error(f"--tolerance {args.tolerance} must be >= 1")
    if args.device != "cpu" and _gpu_index(args.device) is None:
        p.error(f"--device {args.device!r} not understood; use cpu, cuda or cuda:N")

    t0 = time.perf_counter()
    base = run_point(1, args, args.think_s)
    log.warning("N=1: %.3f s/step, think %.3f s", base["median_step_s"], base["think_s"])
    points = [base]
    for n in ns[1:]:
        points.append(run_point(n, args, base["think_s"]))
        log.warning("N=%d: %.3f s/step", n, points[-1]["median_step_s"])
    density = 1
    for pt in points:
        pt["latency_vs_alone"] = pt["median_step_s"] / base["median_step_s"]
        pt["within_tolerance"] = pt["latency_vs_alone"] <= args.tolerance
    for pt in points:
        if not pt["within_tolerance"]:
            break
        density = pt["tenants"]
    unshared = run_point(args.unshared, args, base["think_s"], share=False) if args.unshared else None
    result = {"bench": "tinker_density", "definition": DEFINITION, "device": args.device, "host": platform.node(),
              "args": vars(args), "tolerance": args.tolerance, "think_s": base["think_s"],
              "single_tenant_median_step_s": base["median_step_s"], "density": density, "points": points,
              "unshared_point": unshared, "wall_s": time.perf_counter() - t0}
    if unshared is not None:
        same = next((pt for pt in points if pt["tenants"] == args.unshared), None)
        key = "device_mem_used_bytes" if unshared["device_mem_used_bytes"] is not None else "host_pss_bytes"
        if same is not None and same[key] is not None and unshared[key] is not None:
            result["sharing_saves_bytes"] = {"metric": key, "tenants": args.unshared,
                                             "bytes": unshared[key] - same[key],
                                             "expected_about": (args.unshared - 1) * base["base_bytes"],
                                             "note": "less one process's own cost (the base holder's CUDA context "
                                                     "or torch runtime), which sharing adds"}
    text = json.dumps(result, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    log.warning("density %d (tenants per device at <= %.2fx one-tenant step latency, think %.3f s)", density,
                args.tolerance, base["think_s"])
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
