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
* *reference* (``reference`` in the JSON; ``bench/peft_reference.py`` says how, and which settings): what a
  user would run instead, a single-tenant Hugging Face + peft trainer on the dedicated device, measured first
  in a process of its own: the same snapshot, rank, batch and loss. Its median step is ``t_ref``. The toy model
  has none (``--ref-steps 0`` skips it too): the one-tenant figures below stand in.
* *density* (``density``): the largest tested N whose p50 step is at most ``--tolerance`` x ``t_ref``
  (``density_vs_reference`` also gives the same by p90). *baseline*: N = 1, one tenant alone on the device;
  ``density_vs_one_tenant``: the largest tested N such that, for it and every smaller tested N, the point's
  latency is at most ``--tolerance`` x the baseline latency (the earlier definition).
* *think time*: ``--think-s`` seconds, or (default) ``--think-ratio`` x ``t_ref`` (without a reference: x the
  baseline's back-to-back step time, measured in a calibration phase of the N = 1 point). With
  ratio r a tenant alone keeps the device busy 1/(1+r) of the time; the ideal density
  is about 1+r, and what rota's switching costs shows up as the gap.
* *tokens/s and MFU* (every point): ``aggregate_tokens_per_s`` and ``mfu``, 4 x base parameters x that over
  the device's dense bf16 peak (null on CPU, with the reason); ``step_tokens_per_s``: one tenant's own rate.
* *arrivals*: ``staggered`` (default): tenant i starts its measured steps i/N of a period
  (baseline step + think) after tenant 0, as independent jobs would be spread out;
  ``lockstep``: all start together and, with equal think times, stay together, so every
  step queues behind all N (the worst case: about N x the baseline, whatever rota costs).
  ``--think-jitter j`` draws each think time from [1-j, 1+j] x think (seeded).
* *aggregate throughput*: measured steps of all tenants / the span they were measured
  in (steps/s and tokens/s).
* *memory*: on CUDA, device memory in use (``nvidia-smi``) at its peak during the
  point minus before the service started; on CPU, the summed PSS of the base holder and
  the trainer workers; ``mem_per_added_tenant``: (a point's memory - the baseline's) /
  (N - 1). ``--unshared N`` adds one point with base sharing off (every tenant's worker
  loads its own base): the difference to the shared point of the same
  N is the memory sharing saves (about (N-1) x ``base_bytes`` if CUDA IPC shares it).
* *capacity* (``--capacity``): the service's ``capacity_bytes``, so tenants whose working
  sets fit stay resident between turns and a turn moves nothing; ``auto`` (default) is,
  per point, the device's free memory before the service starts minus the base and 1 GiB
  per tenant process (CUDA contexts), or half of ``MemAvailable`` on CPU; ``0`` parks the
  previous holder at every switch (only adapter and Adam state move for LoRA tenants).
* *worker start* (per point): where the start of each worker and base holder went
  (spawn, imports, setup), from ``TinkerService.worker_starts``.
* *latency at the baseline's compute* (``latency_vs_alone_at_base_compute``, reported, not
  used for density): the point's median step with its median ``forward_backward`` compute
  replaced by the baseline's, over the baseline's step. The device's speed drifts between
  points (on the H200, the same forward_backward took 213 to 264 ms in different points);
  this ratio shows what queueing and switching cost apart from that drift.
* *breakdown* (per point, per kind of unit, medians over the measured window; from the
  service's per-unit timing, see ``rota_tinker._http.handles.unit_breakdown``): pipe queue,
  turn wait, restore, compute, release, the long poll's answer lag, and the share of
  units that started a turn (the rest ran in a turn their tenant already held).

The JSON is rewritten after every point, so a run cut short keeps what it measured; a
point that runs past ``--point-timeout-s`` is recorded as failed, with the reason, and
the run goes on.

    # H200 (about 7 minutes): a 2.1 GB fp32 base, 1 to 6 tenants, think 4x the step
    python bench/tinker_density.py --device cuda:0 --tenants 1,2,3,4,5,6 --steps 16 \\
        --point-timeout-s 150 --out bench/results/tinker-density-h200.json
    # think 8x the step, and the memory sharing saves (an unshared point)
    python bench/tinker_density.py --device cuda:0 --tenants 4,6,8 --think-ratio 8 --steps 10 --unshared 4 \\
        --out bench/results/tinker-density-h200-r8.json
    # H200: a Qwen3-1.7B-shaped bf16 base (random init from its config), 1 to 10 tenants, think 4x the step
    python bench/tinker_density.py --device cuda:0 --model qwen3-1.7b --tenants 1,2,4,6,8,10 --steps 12 \\
        --point-timeout-s 300 --out bench/results/tinker-density-h200-qwen3-1.7b.json
    # the same with shared LoRA turns: up to 4 tenants' units at once in one rota turn of the base
    python bench/tinker_density.py --device cuda:0 --model qwen3-1.7b --tenants 1,8,10,12 --steps 10 \\
        --lora-concurrency 4 --out bench/results/tinker-density-h200-qwen3-1.7b-shared.json
    # the same with the batched LoRA worker: every tenant's units in one batched pass (issue 44: >= 32 at
    # <= 1.25x t_ref); on CUDA the N list defaults to 1,8,16,32,48,64
    python bench/tinker_density.py --device cuda:0 --model qwen3-1.7b --steps 8 \\
        --lora-batch --out bench/results/tinker-density-h200-qwen3-1.7b-batch.json
    # CPU smoke run of the same path (a tiny Qwen3 shape) and its peft reference
    python bench/tinker_density.py --device cpu --model qwen3-tiny --dtype float32 --batch 2 --seq-len 16 \\
        --tenants 1,2 --steps 3 --warmup 1 --ref-steps 5
    # CPU smoke run (about a minute)
    python bench/tinker_density.py --device cpu --vocab 256 --dim 64 --layers 2 --heads 2 --batch 2 \\
        --seq-len 16 --tenants 1,2 --steps 3 --warmup 1 --unshared 2
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np
import peft_reference as ref

from rota_tinker.testing import QWEN3_SHAPES

log = logging.getLogger("tinker_density")
_HF_SPECS: dict[tuple[str, str], object] = {}  # (shape, dtype) -> its spec: one snapshot per run

DEFINITION = ("density = largest tested N whose median per-step latency (forward_backward+optim_step, all "
              "tenants' measured steps) is <= tolerance x t_ref, the median step of a single-tenant HF+peft trainer "
              "on the dedicated device (reference; without one: density_vs_one_tenant); density_vs_one_tenant = "
              "largest tested N such that, for it and every smaller tested N, that latency is <= tolerance x the "
              "N=1 median (one tenant per device); every tenant thinks think_s seconds off-device between steps; "
              "all N LoRA tenants share one resident base (unless share_lora_base is false); arrivals staggered by "
              "1/N of a period (baseline step + think) unless arrivals is lockstep; with lora_concurrency > 1 up "
              "to that many LoRA units run at once in one shared rota turn of the base (every point, N=1 included)")
BREAKDOWN = ("queue_s", "acquire_s", "wait_s", "restore_s", "compute_s", "release_s", "reply_s", "answer_lag_s",
             "total_s", "parked_s")
MONO = time.monotonic() - time.perf_counter()  # perf_counter stamps + MONO = monotonic stamps (the service's)


class PointFailed(Exception):
    """A point could not finish (timeout or error); the reason goes into the JSON."""


def _batch(vocab: int, length: int, n: int, seed: int) -> list:
    """``n`` next-token rows of ``length`` tokens as tinker Datums (the peft reference trains on the same rows)."""
    from tinker import types

    return [types.Datum(model_input=types.ModelInput.from_ints(toks[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(toks[1:].astype(np.int64))})
            for toks in ref.rows(vocab, length, n, seed)]


def _device_mem(device: str, what: str = "used") -> int | None:
    """Device memory ``used`` or ``free`` (bytes, whole device, nvidia-smi); None on CPU or without nvidia-smi."""
    mib = ref.nvidia_smi(device, f"memory.{what}")
    return None if mib is None else int(mib) * 2**20


def _capacity(args: argparse.Namespace, n: int, base_bytes: int) -> int:
    """The service's capacity_bytes for a point of ``n`` tenants (see ``--capacity`` in the module docstring)."""
    if args.capacity != "auto":
        return int(args.capacity)
    free = _device_mem(args.device, "free")
    if free is not None:
        return max(0, free - base_bytes - n * 2**30)
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    return avail // 2


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
            used = _device_mem(self.device)
            if used is not None:
                self.peak = used if self.peak is None else max(self.peak, used)
            self._stop.wait(self.every_s)

    def __enter__(self) -> _Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def run_point(n: int, args: argparse.Namespace, think_s: float | None, share: bool = True,
              period_s: float = 0.0) -> dict:
    """N tenants concurrently; think_s None: calibrate it first (N = 1 only). Latencies, throughput, memory.

    Bounded by ``args.point_timeout_s``: past it, raises :class:`PointFailed` (the service is stopped either way).
    """
    import tinker
    from tinker import types

    from rota.testing import running_orchestrator
    from rota_tinker import ServiceConfig, Tenant, TinkerService

    deadline = time.monotonic() + args.point_timeout_s

    def left() -> float:
        """Seconds a wait may still take (at least 1, so a late wait fails by timing out, not at once)."""
        return max(1.0, deadline - time.monotonic())

    spec = base_spec(args)
    tenants = tuple(Tenant(f"t{i}", "tml-" + hashlib.sha256(f"rota-bench-tenant:{i}".encode()).hexdigest()[:43])
                    for i in range(n))
    idle = _device_mem(args.device)
    base_bytes = base_spec_bytes(spec)
    capacity = _capacity(args, n, base_bytes)
    data = _batch(spec.vocab, args.seq_len, args.batch, seed=0)
    stage = ["starting the service"]
    with contextlib.ExitStack() as stack:
        # capacity > 0: the service runs its own orchestrator with it; else one here, without
        endpoint = None if capacity else stack.enter_context(running_orchestrator())[0]
        config = ServiceConfig(tenants=tenants, data_dir=tempfile.mkdtemp(prefix="tinker-density-"),
                               device=args.device, group=f"density-{n}-{int(share)}", endpoint=endpoint,
                               long_poll_s=5.0, base_models={spec.name: spec}, share_lora_base=share,
                               worker_start_timeout_s=min(300.0, args.point_timeout_s),
                               units_per_turn=args.units_per_turn, release_cached=not args.keep_cache,
                               stop_timeout_s=20.0, capacity_bytes=capacity, max_bytes=2**50,
                               lora_concurrency=args.lora_concurrency if share else 1,
                               lora_batch=args.lora_batch and share)
        with TinkerService(config) as svc, _Peak(args.device) as peak:
            t_start = time.perf_counter()
            clients = [tinker.ServiceClient(base_url=svc.url, api_key=t.api_key) for t in tenants]
            try:
                trainers: list = [None] * n
                stage[0] = "creating the LoRA models (worker and base holder start)"

                def create(i: int) -> None:
                    trainers[i] = clients[i].create_lora_training_client(base_model=spec.name, rank=args.rank,
                                                                         seed=i).result(left())

                _in_threads(create, n, deadline, stage)
                start_s = time.perf_counter() - t_start
                lat: dict[str, list[float]] = {t.name: [] for t in tenants}
                spans: list[tuple[float, float]] = []
                steps_of: dict[str, list[tuple[float, float]]] = {t.name: [] for t in tenants}
                think = [think_s]
                calibrated = threading.Event()
                if think_s is not None:
                    calibrated.set()
                barrier = threading.Barrier(n)
                stage[0] = "warmup and measured steps"

                def step(tc: object) -> float:
                    t0 = time.perf_counter()
                    fb = tc.forward_backward(data, "cross_entropy")  # type: ignore[attr-defined]
                    op = tc.optim_step(types.AdamParams(learning_rate=1e-4))  # type: ignore[attr-defined]
                    fb.result(left())
                    op.result(left())
                    return time.perf_counter() - t0

                def loop(i: int) -> None:
                    tc, name = trainers[i], tenants[i].name
                    rng = random.Random(1000 + i)
                    barrier.wait(left())
                    for _ in range(args.warmup):
                        step(tc)
                    if not calibrated.is_set():  # N = 1 only: back-to-back steps set the think time
                        back_to_back = statistics.median(step(tc) for _ in range(3))
                        think[0] = args.think_ratio * back_to_back
                        calibrated.set()
                    barrier.wait(left())
                    if args.arrivals == "staggered" and n > 1:
                        time.sleep(i * period_s / n)
                    for _ in range(args.steps):
                        t0 = time.perf_counter()
                        lat[name].append(step(tc))
                        spans.append((t0, time.perf_counter()))
                        steps_of[name].append(spans[-1])
                        time.sleep(think[0] * rng.uniform(1 - args.think_jitter, 1 + args.think_jitter))

                measure_from = time.monotonic()
                _in_threads(loop, n, deadline, stage)
                holder = svc.base_holder_info(spec.name, timeout_s=left()) if share else None
                pids = [svc.worker_pid(t.name, "trainer") for t in tenants] + ([holder["pid"]] if holder else [])
                pids += [h.pid for h in svc.state.batchers.values()]  # --lora-batch: the batched worker
                host_pss = _pss([p for p in pids if p is not None])
                units = svc.unit_timings()
                starts = svc.worker_starts()
            finally:
                for c in clients:  # finish the sessions: no heartbeats left running against a stopped service
                    with contextlib.suppress(Exception):
                        c.close("success").result(10)
    every = [x for v in lat.values() for x in v]
    window = max(e for _, e in spans) - min(s for s, _ in spans)
    steps = len(every)
    first = min(s for s, _ in spans) + MONO
    measured = [u for u in units if u["submitted"] is not None and u["submitted"] >= max(first, measure_from)]
    parked = [u["parked_bytes"] for u in measured if u.get("parked_bytes")]
    return {"tenants": n, "share_lora_base": share, "think_s": think[0], "median_step_s": statistics.median(every),
            "p90_step_s": float(np.percentile(every, 90)),
            "per_tenant_median_s": {k: statistics.median(v) for k, v in lat.items()},
            "aggregate_steps_per_s": steps / window,
            "aggregate_tokens_per_s": steps * args.batch * args.seq_len / window,
            "base_model": getattr(spec, "name", None), "base_params": spec.params(),  # type: ignore[attr-defined]
            "worker_start_s": start_s, "worker_starts": starts, "capacity_bytes": capacity, "base_bytes": base_bytes,
            "holder_bytes": holder["bytes"] if holder else None,
            "device_mem_idle_bytes": idle, "device_mem_peak_bytes": peak.peak,
            "device_mem_used_bytes": (peak.peak - idle) if peak.peak is not None and idle is not None else None,
            "host_pss_bytes": host_pss, "breakdown": breakdown(measured),
            "median_client_s": _client_overhead(steps_of, measured),
            "parks": len(parked), "max_parked_bytes": max(parked, default=0.0)}


def _client_overhead(steps_of: dict[str, list[tuple[float, float]]], units: list[dict]) -> float | None:
    """Median over steps of: the client's step latency minus the span the service saw (first unit
    submitted to last answered): HTTP requests, SDK scheduling, and fetching the answers."""
    extra = []
    for tenant, steps in steps_of.items():
        mine = [u for u in units if u["tenant"] == tenant and u["answered"] is not None]
        for t0, t1 in steps:
            inside = [u for u in mine if t0 + MONO <= u["submitted"] <= t1 + MONO]
            if inside:
                span = max(u["answered"] for u in inside) - min(u["submitted"] for u in inside)
                extra.append((t1 - t0) - span)
    return statistics.median(extra) if extra else None


def breakdown(units: list[dict]) -> dict:
    """Per kind of unit: count, share that started a turn, failures, and the median of each part (seconds)."""
    out: dict = {}
    for kind in sorted({u["kind"] for u in units}):
        mine = [u for u in units if u["kind"] == kind]
        row: dict = {"units": len(mine), "new_turn_share": statistics.mean(u.get("new_turn", 0.0) for u in mine),
                     "failed": sum(u["failed"] for u in mine)}
        for part in BREAKDOWN:
            values = [u[part] for u in mine if part in u]
            if values:
                row[f"median_{part}"] = statistics.median(values)
        sharing = [u["units_sharing"] for u in mine if "units_sharing" in u]
        if sharing:  # units in the shared LoRA turn when each entered (itself included)
            row["mean_units_sharing"], row["max_units_sharing"] = statistics.mean(sharing), max(sharing)
        out[kind] = row
    return out


def _describe(pt: dict) -> str:
    """One line per kind: where a unit's time went (milliseconds)."""
    lines = []
    for kind, row in pt.get("breakdown", {}).items():
        parts = " ".join(f"{p[:-2]} {row[f'median_{p}'] * 1e3:.1f}" for p in BREAKDOWN if f"median_{p}" in row)
        lines.append(f"  {kind}: {row['units']} units, {row['new_turn_share']:.0%} started a turn; median ms: {parts}")
    return "\n".join(lines)


def base_spec(args: argparse.Namespace) -> object:
    """The base model of a run: ``--model toy`` (rota's small test transformer of ``--vocab/--dim/...``) or a
    Qwen3 shape (``--model qwen3-1.7b``): a Hugging Face config-only snapshot the service random-inits, in
    ``--dtype``, served from a hub cache made here (made once per run)."""
    from rota_tinker import BaseModelSpec
    from rota_tinker.testing import qwen3_shaped

    if args.model == "toy":
        return BaseModelSpec("bench/lm", vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.heads,
                             max_len=max(256, args.seq_len), seed=0)
    key = (args.model, args.dtype)
    if key not in _HF_SPECS:
        _HF_SPECS[key] = qwen3_shaped(tempfile.mkdtemp(prefix="tinker-bench-hub-"), args.model, args.dtype)
    return _HF_SPECS[key]


def base_spec_bytes(spec: object) -> int:
    """Bytes of the base's weights (fp32 for the toy model, the config's dtype for a Hugging Face one)."""
    import torch

    from rota_tinker import HfModelSpec
    from rota_tinker._worker.models import TinyLM

    if isinstance(spec, HfModelSpec):
        return spec.params() * getattr(torch, spec.dtype).itemsize
    with torch.device("meta"):
        return sum(p.numel() for p in TinyLM(spec).parameters()) * 4  # type: ignore[arg-type]


def _in_threads(fn: Callable[[int], None], n: int, deadline: float, stage: list[str]) -> None:
    """``fn(i)`` for i < n in daemon threads; PointFailed naming ``stage[0]`` on an error or past ``deadline``."""
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            fn(i)
        except BaseException as e:  # reported below, naming the tenant
            errors.append(RuntimeError(f"tenant t{i}: {type(e).__name__}: {e}"))

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    if stuck:
        raise PointFailed(f"timed out while {stage[0]}: tenants {stuck} still busy at --point-timeout-s")
    if errors:
        raise PointFailed(f"failed while {stage[0]}: {errors[0]}")


def _failed(n: int, share: bool, reason: str) -> dict:
    log.error("N=%d%s failed: %s", n, "" if share else " (unshared)", reason)
    return {"tenants": n, "share_lora_base": share, "failed": True, "reason": reason}


def _point(n: int, args: argparse.Namespace, think_s: float | None, share: bool = True,
           period_s: float = 0.0) -> dict:
    """run_point, with any failure recorded as a failed point rather than raised."""
    try:
        return run_point(n, args, think_s, share, period_s)
    except PointFailed as e:
        return _failed(n, share, str(e))
    except Exception as e:  # a point must not take the measured ones with it
        log.exception("N=%d failed", n)
        return _failed(n, share, f"{type(e).__name__}: {e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0", help="cpu, cuda or cuda:N (every worker and the base holder)")
    p.add_argument("--model", default="toy", choices=("toy", *QWEN3_SHAPES),
                   help="base model: toy (rota's test transformer of --vocab/--dim/--layers/--heads) or a Qwen3 "
                        "shape (a Hugging Face config-only snapshot, random init, served by its hub name)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="dtype of a Qwen3-shaped base (its config's dtype)")
    p.add_argument("--vocab", type=int, default=32000, help="base model: vocabulary size")
    p.add_argument("--dim", type=int, default=2048, help="base model: width")
    p.add_argument("--layers", type=int, default=8, help="base model: transformer blocks")
    p.add_argument("--heads", type=int, default=16, help="base model: attention heads")
    p.add_argument("--tenants", default=None, help="comma-separated N values (1 is always run: the baseline; "
                   "default 1,8,16,32,48,64 on CUDA, 1,2,4,8 on CPU)")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank of every tenant")
    p.add_argument("--batch", type=int, default=8, help="sequences per forward_backward")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="measured steps per tenant")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured steps per tenant first")
    p.add_argument("--ref-steps", type=int, default=20, help="measured steps of the peft reference (0: skip it)")
    p.add_argument("--ref-warmup", type=int, default=3, help="unmeasured steps of the peft reference first")
    p.add_argument("--think-s", type=float, default=None, help="seconds off-device between a tenant's steps")
    p.add_argument("--think-ratio", type=float, default=4.0,
                   help="without --think-s: think time = this x t_ref (no reference: the one-tenant step)")
    p.add_argument("--tolerance", type=float, default=1.25, help="'equal latency' = within this factor of t_ref")
    p.add_argument("--unshared", type=int, default=0, help="also run this N with base sharing off (0: skip)")
    p.add_argument("--arrivals", choices=("staggered", "lockstep"), default="staggered",
                   help="staggered: tenant i starts i/N of a period after tenant 0; lockstep: all together")
    p.add_argument("--think-jitter", type=float, default=0.0,
                   help="each think time is drawn from [1-j, 1+j] x think (0: fixed)")
    p.add_argument("--units-per-turn", type=int, default=4,
                   help="the service's units_per_turn (1: every work unit takes its own turn)")
    p.add_argument("--lora-concurrency", type=int, default=1,
                   help="the service's lora_concurrency: LoRA units on the shared base that run at once in one "
                        "shared turn (1: exclusive turns; every point, N = 1 included, runs with it)")
    p.add_argument("--lora-batch", action="store_true",
                   help="the service's lora_batch: every tenant's LoRA model in one batched worker, queued units "
                        "run as one batched pass (every point, N = 1 included, runs with it)")
    p.add_argument("--keep-cache", action="store_true",
                   help="the service's release_cached=False: a parked tenant keeps its CUDA cache (no re-allocation)")
    p.add_argument("--capacity", default="auto",
                   help="the service's capacity_bytes: a size (e.g. 100GiB), 0 (park at every switch) or auto "
                        "(free device memory less the base and 1 GiB per tenant; CPU: half of MemAvailable)")
    p.add_argument("--point-timeout-s", type=float, default=240.0,
                   help="a point (start, steps, teardown aside) running longer is recorded as failed")
    p.add_argument("--out", default="", help="write the JSON here too (rewritten after every point)")
    args = p.parse_args()
    logging.basicConfig(level=os.environ.get("ROTA_LOG_LEVEL", "WARNING"))
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    if args.tenants is None:
        args.tenants = "1,2,4,8" if args.device == "cpu" else "1,8,16,32,48,64"
    try:
        ns = sorted({1} | {int(x) for x in args.tenants.split(",") if x.strip()})
    except ValueError:
        p.error(f"--tenants {args.tenants!r} must be comma-separated integers")
    if ns[0] < 1:
        p.error(f"--tenants {args.tenants!r} needs positive integers")
    for name in ("vocab", "dim", "layers", "heads", "rank", "batch", "seq_len", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if min(args.warmup, args.unshared, args.ref_steps, args.ref_warmup) < 0:
        p.error("--warmup, --unshared, --ref-steps and --ref-warmup must be >= 0")
    if not 0 <= args.think_jitter < 1:
        p.error(f"--think-jitter {args.think_jitter} must be within [0, 1)")
    if not 1 <= args.lora_concurrency <= 64:
        p.error(f"--lora-concurrency {args.lora_concurrency} must be within [1, 64]")
    if args.lora_batch and args.lora_concurrency > 1:
        p.error("--lora-batch replaces shared LoRA turns: drop --lora-concurrency")
    if args.units_per_turn < 1 or args.point_timeout_s <= 0:
        p.error("--units-per-turn must be >= 1 and --point-timeout-s > 0")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    if args.rank > args.dim and args.model == "toy":
        p.error(f"--rank {args.rank} must be <= --dim {args.dim}")
    if (args.think_s is not None and args.think_s < 0) or args.think_ratio < 0:
        p.error("--think-s and --think-ratio must be >= 0")
    if args.tolerance < 1:
        p.error(f"--tolerance {args.tolerance} must be >= 1")
    if args.device != "cpu" and ref.gpu_index(args.device) is None:
        p.error(f"--device {args.device!r} not understood; use cpu, cuda or cuda:N")
    if args.capacity != "auto":
        from rota.config import parse_bytes
        from rota.errors import RotaError

        try:
            args.capacity = parse_bytes(args.capacity, what="--capacity")
        except RotaError as e:
            p.error(str(e))

    t0 = time.perf_counter()
    result: dict = {"bench": "tinker_density", "definition": DEFINITION, "device": args.device,
                    "host": platform.node(), "args": vars(args), "tolerance": args.tolerance, "complete": False,
                    "density": None, "density_vs_one_tenant": None, "mfu_definition": ref.MFU_DEFINITION,
                    "device_peak": ref.peak_flops(args.device), "points": [], "unshared_point": None}
    spec = base_spec(args)
    reference, think_s = ref.prepare(result, spec, args)
    params = spec.params()  # type: ignore[attr-defined]

    def report(pt: dict) -> None:
        _report(pt, base, args.tolerance)
        ref.annotate(pt, args, params, result["device_peak"], reference)

    base = _point(1, args, think_s)
    result["points"].append(base)
    if base.get("failed"):
        _write(result, args, t0)
        sys.exit(f"the baseline (N=1) failed: {base['reason']}")
    period = base["median_step_s"] + base["think_s"]
    result.update(think_s=base["think_s"], single_tenant_median_step_s=base["median_step_s"], period_s=period)
    report(base)
    _write(result, args, t0)
    for n in ns[1:]:
        pt = _point(n, args, base["think_s"], period_s=period)
        result["points"].append(pt)
        report(pt)
        _write(result, args, t0)
    if args.unshared:
        result["unshared_point"] = _point(args.unshared, args, base["think_s"], share=False, period_s=period)
        report(result["unshared_point"])
    ref.set_densities(result, reference, args.tolerance)
    unshared = result["unshared_point"]
    if unshared is not None and not unshared.get("failed"):
        same = next((pt for pt in result["points"] if pt["tenants"] == args.unshared and not pt.get("failed")), None)
        key = _mem_metric(unshared)
        if same is not None and same[key] is not None and unshared[key] is not None:
            result["sharing_saves_bytes"] = {"metric": key, "tenants": args.unshared,
                                             "bytes": unshared[key] - same[key],
                                             "expected_about": (args.unshared - 1) * base["base_bytes"],
                                             "note": "less one process's own cost (the base holder's CUDA context "
                                                     "or torch runtime), which sharing adds"}
    result["complete"] = True
    text = _write(result, args, t0)
    log.warning("%s (%s arrivals)", ref.summary(result), args.arrivals)
    sys.stdout.write(text + "\n")


def _mem_metric(pt: dict) -> str:
    """A point's memory figure: device memory on CUDA, else the processes' PSS."""
    return "device_mem_used_bytes" if pt.get("device_mem_used_bytes") is not None else "host_pss_bytes"


def _report(pt: dict, base: dict, tolerance: float) -> None:
    """Log a point's latency and breakdown; set its ratio to the baseline."""
    if pt.get("failed"):
        return
    pt["latency_vs_alone"] = pt["median_step_s"] / base["median_step_s"]
    pt["within_tolerance"] = pt["latency_vs_alone"] <= tolerance
    key = _mem_metric(pt)
    if pt is not base and pt.get(key) is not None and base.get(key) is not None and pt["tenants"] > 1:
        pt["mem_per_added_tenant"] = {"metric": key, "bytes": (pt[key] - base[key]) / (pt["tenants"] - 1)}
    compute = [p.get("breakdown", {}).get("ForwardBackward", {}).get("median_compute_s") for p in (pt, base)]
    if None not in compute:  # the device's own speed drifts between points; this ratio takes that out
        pt["latency_vs_alone_at_base_compute"] = (pt["median_step_s"] - compute[0] + compute[1]) / base["median_step_s"]
    extra = f", think {pt['think_s']:.3f} s" if pt is base else ""
    client = pt["median_client_s"]
    starts = pt.get("worker_starts") or {}
    slowest = max(starts.items(), key=lambda kv: kv[1]["total_s"], default=None)
    slow = "" if slowest is None else " (slowest: {} {})".format(
        slowest[0], " ".join(f"{k[:-2]} {v:.1f}" for k, v in slowest[1].items()))
    if "latency_vs_alone_at_base_compute" in pt and pt is not base:
        extra += f" ({pt['latency_vs_alone_at_base_compute']:.2f}x at the baseline's forward_backward compute)"
    if "mem_per_added_tenant" in pt:
        extra += f", {pt['mem_per_added_tenant']['bytes'] / 2**30:.2f} GiB per added tenant"
    log.warning("N=%d%s: %.3f s/step (%.2fx alone)%s, capacity %.1f GiB, workers started in %.1f s%s; client/HTTP "
                "%s ms a step; %d parks, at most %.1f MB each\n%s", pt["tenants"],
                "" if pt["share_lora_base"] else " (unshared)", pt["median_step_s"], pt["latency_vs_alone"], extra,
                pt["capacity_bytes"] / 2**30, pt["worker_start_s"], slow,
                "?" if client is None else f"{client * 1e3:.1f}", pt["parks"], pt["max_parked_bytes"] / 1e6,
                _describe(pt))


def _write(result: dict, args: argparse.Namespace, t0: float) -> str:
    """The JSON so far, written to ``--out`` (atomically) after every point."""
    result["wall_s"] = time.perf_counter() - t0
    text = json.dumps(result, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            f.write(text + "\n")
        os.replace(tmp, args.out)
    return text


if __name__ == "__main__":
    main()
