"""`rota demo`: three jobs (two RL, one SFT), each a trainer and a sampler process,
run three ways — dedicated, serial, time-sliced through rota — and compared.

This module starts the worker processes and collects what they report; the math
lives in :mod:`rota.demo.workloads`, the per-process loop in :mod:`rota.demo.worker`,
the table/JSON/PNG in :mod:`rota.demo.report`. It imports no torch itself.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rota._engine import OrchestratorConfig
from rota._inproc import running_orchestrator
from rota.demo.worker import WorkerReport, WorkerSpec, worker_main
from rota.demo.workloads import ModelSize
from rota.errors import InvalidArgument

JOBS = (("rl-a", "rl"), ("rl-b", "rl"), ("sft", "sft"))
WORKER_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class DemoConfig:
    """Validated options of one demo run."""

    steps: int = 16
    groups: int = 2
    device: str = "cpu"
    size: ModelSize = field(default_factory=ModelSize)
    off_device_s: float = 0.1
    seed: int = 0
    modes: tuple[str, ...] = ("dedicated", "serial", "timesliced")
    capacity_bytes: int = 0  # per group; 0 = park every other resident at each switch

    def check(self) -> None:
        if self.steps < 1:
            raise InvalidArgument(f"--steps {self.steps} must be >= 1")
        if self.groups not in (1, 2):
            raise InvalidArgument(f"--groups {self.groups} must be 1 (everything on one device) or 2 "
                                  "(trainers and samplers on separate devices)")
        if self.off_device_s < 0:
            raise InvalidArgument(f"--off-device {self.off_device_s} must be >= 0 seconds")
        bad = [m for m in self.modes if m not in ("dedicated", "serial", "timesliced")]
        if bad or not self.modes:
            raise InvalidArgument(f"--modes {','.join(self.modes)!r}: choose from dedicated, serial, timesliced")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise InvalidArgument(f"--device {self.device!r}: use cpu or cuda")

    def eval_every(self) -> int:
        return max(1, min(4, self.steps))


@dataclass
class ModeResult:
    """One mode's makespan and every worker's report."""

    mode: str
    makespan_s: float
    devices: int
    reports: dict[str, WorkerReport]
    busy_seconds: float = 0.0
    switches: int = 0
    job_spans: dict[str, float] = field(default_factory=dict)


def _group_of(role: str, cfg: DemoConfig) -> str:
    return "gpu0" if cfg.groups == 1 or role == "trainer" else "gpu1"


def _device_of(role: str, cfg: DemoConfig) -> str:
    if cfg.device == "cpu" or ":" in cfg.device:
        return cfg.device
    import torch  # only for --device cuda: place the two groups on two GPUs when there are two

    return "cuda:1" if torch.cuda.device_count() > 1 and _group_of(role, cfg) == "gpu1" else "cuda:0"


def _specs(cfg: DemoConfig, jobs: tuple[tuple[str, str], ...], endpoint: str | None) -> list[WorkerSpec]:
    specs = []
    for i, (job, kind) in enumerate(jobs):
        for role in ("trainer", "sampler"):
            specs.append(WorkerSpec(job=job, kind=kind, role=role, steps=cfg.steps, seed=cfg.seed + i,
                                    size=cfg.size, device=_device_of(role, cfg), group=_group_of(role, cfg),
                                    endpoint=endpoint, off_device_s=cfg.off_device_s,
                                    eval_every=cfg.eval_every()))
    return specs


def _run_workers(specs: list[WorkerSpec], progress: Callable[[str], None], label: str) -> tuple[float, dict]:
    """Start the workers of ``specs``, release them together, wait; return (makespan, reports)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    go = ctx.Event()
    procs = []
    by_job: dict[str, list[WorkerSpec]] = {}
    for s in specs:
        by_job.setdefault(s.job, []).append(s)
    for job_specs in by_job.values():
        trainer = next(s for s in job_specs if s.role == "trainer")
        sampler = next(s for s in job_specs if s.role == "sampler")
        to_trainer_r, to_trainer_w = ctx.Pipe(duplex=False)
        to_sampler_r, to_sampler_w = ctx.Pipe(duplex=False)
        procs.append(ctx.Process(target=worker_main, args=(trainer, to_trainer_r, to_sampler_w, results, go),
                                 name=trainer.name, daemon=True))
        procs.append(ctx.Process(target=worker_main, args=(sampler, to_sampler_r, to_trainer_w, results, go),
                                 name=sampler.name, daemon=True))
    for p in procs:
        p.start()
    try:
        _collect(results, procs, {"ready"}, len(procs), progress, label)
        start = time.monotonic()
        go.set()
        reports = _collect(results, procs, {"done"}, len(procs), progress, label)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    for r in reports.values():  # times relative to the common start
        r.events = [(k, a - start, b - start) for k, a, b in r.events]
        r.start, r.end = 0.0, r.end - start
    return max(r.end for r in reports.values()), reports


def _collect(results: Any, procs: list, kinds: set[str], count: int, progress: Callable[[str], None],
             label: str) -> dict[str, Any]:
    got: dict[str, Any] = {}
    deadline = time.monotonic() + WORKER_TIMEOUT_S
    while len(got) < count:
        try:
            kind, name, payload = results.get(timeout=1.0)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                raise RuntimeError(f"demo worker {dead[0].name} died with exit code {dead[0].exitcode}") from None
            if time.monotonic() > deadline:
                raise RuntimeError(f"demo workers did not finish within {WORKER_TIMEOUT_S:.0f} s") from None
            continue
        if kind == "progress":
            step, loss = payload
            progress(f"[{label}] {name} step {step + 1} loss {loss:.4f}")
        elif kind in kinds:
            got[name] = payload
    return got


def run_demo(cfg: DemoConfig, progress: Callable[[str], None]) -> dict[str, ModeResult]:
    """Run each requested mode and return its result."""
    cfg.check()
    out: dict[str, ModeResult] = {}
    if "dedicated" in cfg.modes:
        progress("dedicated: every worker on its own device, all jobs at once (reference losses)")
        span, reports = _run_workers(_specs(cfg, JOBS, None), progress, "dedicated")
        out["dedicated"] = ModeResult("dedicated", span, devices=2 * len(JOBS), reports=reports)
    if "serial" in cfg.modes:
        progress(f"serial: one job after another on {cfg.groups} device(s)")
        total, reports, spans = 0.0, {}, {}
        for job in JOBS:
            span, job_reports = _run_workers(_specs(cfg, (job,), None), progress, "serial")
            for r in job_reports.values():  # lay the jobs end to end on one time axis
                r.events = [(k, a + total, b + total) for k, a, b in r.events]
                r.start, r.end = total, r.end + total
            spans[job[0]] = span
            total += span
            reports.update(job_reports)
        out["serial"] = ModeResult("serial", total, devices=cfg.groups, reports=reports, job_spans=spans)
    if "timesliced" in cfg.modes:
        progress(f"time-sliced: all jobs at once, taking turns through rota on {cfg.groups} group(s)")
        config = OrchestratorConfig(ttl_s=60.0, park_timeout_s=600.0, capacity_bytes=cfg.capacity_bytes)
        with running_orchestrator(config) as (endpoint, engine):
            span, reports = _run_workers(_specs(cfg, JOBS, endpoint), progress, "time-sliced")
            groups = list(engine.groups.values())
            busy = sum(g.busy_seconds for g in groups)
            switches = sum(g.switches for g in groups)
        out["timesliced"] = ModeResult("timesliced", span, devices=cfg.groups, reports=reports, busy_seconds=busy,
                                       switches=switches)
    return out
