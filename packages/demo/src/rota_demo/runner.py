"""`rota demo`: three jobs (two RL, one SFT), each a trainer and a sampler process,
run three ways — dedicated, serial, time-sliced through rota — and compared.

Dedicated and serial come from the same runs: each job alone on its own devices (its
trainer's and its sampler's), one job after another. Serial is those runs end to end
(makespan = the sum); dedicated is what a cluster with a device per worker would see if
all jobs ran at once (makespan = the longest job alone, on 2 devices per job), and every
time-sliced loss curve is compared with those runs.

This module (after :mod:`rota_demo.memory` sized the run against the host and the device) starts the worker processes
(with one shared weight-push buffer per job, :mod:`rota_demo.push`) and collects what
they report; the math lives in :mod:`rota_demo.workloads`, the per-process loop in
:mod:`rota_demo.worker`, the table/JSON/PNG in :mod:`rota_demo.report`. Modes run one
after another, and every worker of a mode has exited before the next mode starts, so
their host memory never overlaps.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import queue
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rota import auth
from rota.errors import InvalidArgument
from rota.orchestrator import OrchestratorConfig, running_orchestrator
from rota.policies import Fifo, Priority, ResidentFirst
from rota_demo.memory import check_device_fits, cuda_total_bytes, host_memory_plan, push_plan
from rota_demo.push import WeightPush
from rota_demo.worker import WorkerReport, WorkerSpec, worker_main
from rota_demo.workloads import ModelSize

__all__ = ["JOBS", "POLICIES", "SETUP_PHASES", "WORKER_TIMEOUT_S", "DemoConfig", "ModeResult", "Setup",
           "WorkerFailed", "forkserver_preload", "prepare_demo", "run_demo", "run_modes", "setup_phases",
           "worker_specs"]

JOBS = (("rl-a", "rl"), ("rl-b", "rl"), ("sft", "sft"))
# Time-sliced turn order. "priority": an RL job's next step waits for its own trainer and
# sampler in turn (on-policy), so their turns go first; the SFT job, which only waits for
# its data loader, fills the gaps. "fifo": first come, first served.
POLICIES = {"priority": {"rl": 1, "sft": 0}, "fifo": {"rl": 0, "sft": 0}}
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
    record_digests: bool = False  # test hook: workers record a weights digest at every push (both ends)
    host_memory_bytes: int = 0  # host memory the run may use; 0 = read MemAvailable (or the cgroup's room)
    policy: str = "priority"  # time-sliced: "priority" (RL trainers and samplers before SFT's) or "fifo"
    resident_first_s: float = 0.0  # > 0 (with capacity_bytes): resident waiters first, parked ones after this long
    sft_turns: int = 4  # the SFT trainer's microbatches per step, a turn each (same sequence in every mode)
    elastic: bool = False  # time-sliced: one group over every GPU of the host, each turn placed by rota
    capacity_how: str = ""  # where capacity_bytes came from, for the summary (see auto_capacity)
    engine: str = "toy"  # toy: rota's own models and sampler; hf | vllm: LLM jobs (rota_demo.llm_worker)
    llm_sizes: tuple[Any, ...] = ()  # --engine hf|vllm: each job's rota_demo.llm_models.LlmSize, in JOBS order
    cache_dir: str = ""  # --engine hf|vllm: where the built starting checkpoints are kept

    def sized_jobs(self) -> list[tuple[str, Any]]:
        """(job, its model size) for every job, in JOBS order."""
        return [(job, self.job_size(job)) for job, _ in JOBS]

    def job_size(self, job: str) -> Any:
        """The model size of ``job``: the same for every job with the toy engine, its own in the LLM mode."""
        return self.llm_sizes[[j for j, _ in JOBS].index(job)] if self.llm_sizes else self.size

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
        if self.resident_first_s < 0 or (self.resident_first_s and not self.capacity_bytes):
            raise InvalidArgument(f"--resident-first {self.resident_first_s:g} needs --capacity and must be >= 0 "
                                  "seconds (without the device's size nobody stays resident)")
        sft_batch = self.job_size("sft").batch
        if self.sft_turns < 1 or sft_batch % self.sft_turns:
            raise InvalidArgument(f"--sft-turns {self.sft_turns} must be >= 1 and divide --batch {sft_batch} "
                                  "(each turn takes an equal microbatch)")
        if self.engine not in ("toy", "hf", "vllm") or (self.engine != "toy") != bool(self.llm_sizes):
            raise InvalidArgument(f"--engine {self.engine!r}: choose from toy, hf, vllm (hf and vllm need the "
                                  "jobs' LLM sizes)")
        if self.engine == "vllm" and not self.device.startswith("cuda"):
            from rota_demo.llm_engines import sleep_mode_available

            if not sleep_mode_available():
                raise InvalidArgument("--engine vllm runs vLLM with sleep mode, which needs a CUDA device (vLLM "
                                      "refuses it on CPU); use --device cuda, or --engine hf (the transformers "
                                      "stand-in) on CPU")
        if self.policy not in POLICIES:
            raise InvalidArgument(f"--policy {self.policy!r}: choose from {', '.join(POLICIES)}")
        if self.elastic and not self.device.startswith("cuda"):
            raise InvalidArgument(f"--elastic places turns on the host's GPUs; it needs --device cuda (got "
                                  f"{self.device!r})")
        if self.host_memory_bytes < 0:
            raise InvalidArgument(f"--host-memory {self.host_memory_bytes} must be > 0 bytes (omit it to read "
                                  "MemAvailable)")

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
    prefetch: dict[str, int] = field(default_factory=dict)  # time-sliced: the orchestrator's prefetch counters
    job_spans: dict[str, float] = field(default_factory=dict)
    busy_by_group: dict[str, float] = field(default_factory=dict)  # time-sliced: held seconds per group or lane
    how: str = ""  # how the mode was measured, for the report
    setups: list[Setup] = field(default_factory=list)  # the wall time around each measured run (not part of it)


@dataclass(frozen=True)
class Setup:
    """What one start of workers cost outside the measured run: from the first spawn to "go", from the last
    report to every process gone, where the last worker ready spent its set-up, and when each worker reached
    each of its marks (seconds after the first spawn: which steps overlap, and whether one waits for another)."""

    label: str
    setup_s: float
    teardown_s: float
    last_ready: str
    phases_s: dict[str, float]
    marks_s: dict[str, dict[str, float]] = field(default_factory=dict)

    def describe(self) -> str:
        parts = ", ".join(f"{k} {v:.1f}" for k, v in self.phases_s.items())
        return f"ready in {self.setup_s:.1f} s (the last, {self.last_ready}: {parts} s)"


#: a worker's set-up milestones (worker_main's marks), each phase named by what ends at it ("set_device" also
#: holds torch.use_deterministic_algorithms, which imports torch._inductor.config: 3.7-7.5 s per toy worker on an
#: H100 until the forkserver preloaded it, 0.2-0.6 s since; "CUDA context": a synchronize after set_device)
SETUP_PHASES = (("spawn+imports", "entered"), ("torch", "torch"), ("set_device", "device"),
                ("CUDA context", "context"), ("engine imports", "imported"),
                ("waited to build", "build"),
                ("turn+build+warm-up", "built"), ("push buffer", "push_pinned"), ("host pool", "ready"))


def setup_phases(spawned: float, marks: dict[str, float]) -> dict[str, float]:
    """Seconds of each set-up phase of a worker spawned at ``spawned`` (monotonic) that reported ``marks``."""
    out, last = {}, spawned
    for name, mark in SETUP_PHASES:
        at = marks.get(mark, last)
        out[name] = max(0.0, at - last)
        last = at
    return out


ELASTIC_GROUP = "gpus"  # --elastic: the one group over every GPU (its lanes are gpus@cuda:0, gpus@cuda:1...)


def _group_of(role: str, cfg: DemoConfig) -> str:
    return "gpu0" if cfg.groups == 1 or role == "trainer" else "gpu1"


def elastic_devices() -> tuple[str, ...]:
    """Every GPU this process sees: the devices of the --elastic group."""
    import torch

    return tuple(f"cuda:{i}" for i in range(torch.cuda.device_count()))


def _device_of(role: str, cfg: DemoConfig) -> str:
    if cfg.device == "cpu" or ":" in cfg.device:
        return cfg.device
    import torch  # only for --device cuda: place the two groups on two GPUs when there are two

    return "cuda:1" if torch.cuda.device_count() > 1 and _group_of(role, cfg) == "gpu1" else "cuda:0"


def worker_specs(cfg: DemoConfig, jobs: tuple[tuple[str, str], ...], endpoint: str | None,
                 device_total: int | None = None) -> list[WorkerSpec]:
    """Both workers of each job in ``jobs``; shared through ``endpoint`` (None: dedicated). ``device_total``: the
    device's bytes for the vLLM engines' footprint hints (None: read from the device)."""
    specs = []
    # the vLLM engines' footprint hints: without them a capacity counts an engine that tracked nothing yet as 0
    # bytes, keeps residents beside it, and vLLM finds less free memory than its share
    total = 0 if cfg.engine != "vllm" or not endpoint else \
        device_total if device_total is not None else cuda_total_bytes(_device_of("sampler", cfg))
    for job, kind in jobs:
        seed = cfg.seed + [j for j, _ in JOBS].index(job)  # a job's seed does not depend on who runs beside it
        for role in ("trainer", "sampler"):
            # A sampler parks only when switches park everything (no capacity): only then pin its pool ahead.
            elastic = elastic_devices() if cfg.elastic and endpoint else ()
            specs.append(WorkerSpec(job=job, kind=kind, role=role, steps=cfg.steps, seed=seed, devices=elastic,
                                    size=cfg.job_size(job), engine=cfg.engine,
                                    device=elastic[0] if elastic else _device_of(role, cfg),
                                    group=ELASTIC_GROUP if elastic else _group_of(role, cfg),
                                    endpoint=endpoint, off_device_s=cfg.off_device_s,
                                    eval_every=cfg.eval_every(), record_digests=cfg.record_digests,
                                    priority=POLICIES[cfg.policy][kind], sft_turns=cfg.sft_turns,
                                    prepare_pool=role == "trainer" or cfg.capacity_bytes == 0,
                                    footprint_hint=cfg.job_size(job).engine_footprint(cfg.engine, total)
                                    if role == "sampler" and total else 0))
    return specs


def _build_stage(spec: WorkerSpec) -> tuple[int, int]:
    """When a worker builds: in rising priority, and a vLLM engine after the trainers of its priority. vLLM's
    start-up profiling counts device memory that any process allocates meanwhile as its own (the device's used
    memory, not its process's), so a trainer building beside it (54 GiB for the 4B job) would leave it no KV cache:
    it refuses to start. Dedicated runs have no turns to keep the two apart."""
    return spec.priority, int(spec.engine == "vllm" and spec.role == "sampler")


def _context(specs: list[WorkerSpec]) -> Any:
    """How workers start: from a ``forkserver`` that imported torch, rota and the worker's modules once (each
    spawned interpreter took seconds to import them: 5 s per worker on the GPU host, before its CUDA context),
    except vLLM jobs, whose engines start from a fresh interpreter (``spawn``). No CUDA is initialised in the
    server, and nothing else differs: each worker makes its own CUDA context and builds its state after the
    fork."""
    if specs and specs[0].engine == "vllm":
        return mp.get_context("spawn")
    return _preloaded_context(llm=bool(specs) and specs[0].engine != "toy")


def forkserver_preload(*, llm: bool) -> list[str]:
    """What the workers' ``forkserver`` imports before it forks them (``bench/cuda_context.py`` forks from the same):
    torch, the worker and the rota client and adapter; LLM jobs add transformers' Qwen3 (its modeling module alone
    takes about 2 s to import). ``torch._inductor.config``: ``torch.use_deterministic_algorithms`` imports it, and
    each toy worker spent 3.7-7.5 s there on an H100 (py-spy), on every start's critical path."""
    llm_modules = ["transformers", "transformers.models.qwen3.modeling_qwen3", "rota_demo.llm_worker"] if llm else []
    return ["torch", "torch._inductor.config", *llm_modules, "rota_demo.worker", "rota_fsdp", "rota"]


def _preloaded_context(*, llm: bool) -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(forkserver_preload(llm=llm))
    return ctx


def _run_workers(specs: list[WorkerSpec], progress: Callable[[str], None], label: str,
                 on_go: Callable[[], None] | None = None) -> tuple[float, dict, Setup]:
    """Start the workers of ``specs``, release them together, wait; return (makespan, reports, set-up costs).

    Returns only once every worker process has exited (killed if it hangs), so the next
    mode never starts while this one still holds host memory.
    """
    ctx = _context(specs)
    results = ctx.Queue()
    go, finish = ctx.Event(), ctx.Event()
    procs = []
    stage: dict[str, tuple[int, int]] = {}  # process name -> when it builds (its job's priority, engine after)
    builds: dict[tuple[int, int], Any] = {}  # stage -> the event that lets its workers build
    pushes: list[WeightPush] = []
    by_job: dict[str, list[WorkerSpec]] = {}
    for s in specs:
        by_job.setdefault(s.job, []).append(s)
    try:
        for job_specs in by_job.values():  # (one push buffer per job, sized by its own model)
            stage.update({s.name: _build_stage(s) for s in job_specs})
            trainer = next(s for s in job_specs if s.role == "trainer")
            sampler = next(s for s in job_specs if s.role == "sampler")
            nbytes, dtype = push_plan(trainer.engine, trainer.size)
            push = WeightPush.create(ctx, nbytes, dtype)
            pushes.append(push)
            to_trainer_r, to_trainer_w = ctx.Pipe(duplex=False)
            to_sampler_r, to_sampler_w = ctx.Pipe(duplex=False)
            for spec, inbox, outbox in ((trainer, to_trainer_r, to_sampler_w), (sampler, to_sampler_r, to_trainer_w)):
                build = builds.setdefault(stage[spec.name], ctx.Event())
                procs.append(ctx.Process(target=worker_main, name=spec.name, daemon=True,
                                         args=(spec, inbox, outbox, results, go, push, finish, build)))
        # Every worker starts at once (imports, CUDA context); they build in rising priority: the last to
        # build stays resident (earlier ones may be parked to make room), so the clock starts with the jobs
        # that run first on the device, as in the runs alone.
        spawned = time.monotonic()
        for p in procs:
            p.start()
        ready: dict[str, Any] = {}
        for at in sorted(builds):
            batch = [p for p in procs if stage[p.name] == at]
            builds[at].set()
            ready |= _collect(results, batch, {"ready"}, len(batch), progress, label)
        for push in pushes:  # both workers hold their own handle now; the buffer goes when they exit
            push.close()
        if on_go is not None:
            on_go()
        start = time.monotonic()
        last = max(ready, key=lambda n: ready[n]["ready"])
        marks = {name: {k: round(v - spawned, 3) for k, v in sorted(got.items(), key=lambda kv: kv[1])}
                 for name, got in sorted(ready.items())}
        setup = Setup(label, start - spawned, 0.0, last, setup_phases(spawned, ready[last]), marks)
        progress(f"[{label}] {len(procs)} workers {setup.describe()}")
        go.set()
        reports = _collect(results, procs, {"done"}, len(procs), progress, label)
        done = time.monotonic()
    except KeyboardInterrupt:  # Ctrl-C (the workers ignore it): stop them now, not after their turns
        for p in procs:
            if p.pid is not None and p.is_alive():
                p.terminate()
        raise
    finally:
        finish.set()  # every worker reported (or one died): all exit now, after the measured run
        for push in pushes:
            push.close()
        for p in procs:
            if p.pid is None:
                continue
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()  # reaped: its pinned pools and push buffer are gone before the next mode
    setup = dataclasses.replace(setup, teardown_s=time.monotonic() - done)
    for r in reports.values():  # times relative to the common start; setup (before it) is not part of the run
        r.events = [(k, a - start, b - start) for k, a, b in r.events if b >= start]
        r.start, r.end = 0.0, r.end - start
    return max(r.end for r in reports.values()), reports, setup


class WorkerFailed(RuntimeError):
    """A worker raised (it names its error), died, or did not finish in time: the run stops there."""


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
                raise WorkerFailed("demo worker(s) died: " + ", ".join(f"{p.name} (exit code {p.exitcode})"
                                                                       for p in dead)) from None
            if time.monotonic() > deadline:
                raise WorkerFailed(f"demo workers did not finish within {WORKER_TIMEOUT_S:.0f} s") from None
            continue
        if kind == "failed":  # the first worker that raised: the cause (its traceback is above, from its process)
            raise WorkerFailed(f"demo worker {name} failed: {payload} (its traceback is above)")
        if kind == "progress":
            step, loss = payload
            progress(f"[{label}] {name} step {step + 1} loss {loss:.4f}")
        elif kind in kinds:
            got[name] = payload
    return got


def starting_checkpoints(cfg: DemoConfig, progress: Callable[[str], None]) -> tuple[Any, ...]:
    """The LLM jobs' sizes with their checkpoints, built (or found in ``cfg.cache_dir``) in a process of its own,
    so this one never holds the models' memory (nor a CUDA context) while the modes run."""
    ctx = _preloaded_context(llm=True) if cfg.device == "cpu" else mp.get_context("spawn")
    jobs = [(size, cfg.seed + i) for i, size in enumerate(cfg.llm_sizes)]
    t0 = time.monotonic()
    with ctx.Pool(1) as pool:
        built = pool.starmap(_build_checkpoint, [(size, seed, cfg.device, cfg.cache_dir) for size, seed in jobs])
    for (job, _), (path, fresh) in zip(JOBS, built, strict=True):
        progress(f"{job}: checkpoint {path} ({'built' if fresh else 'cached'})")
    progress(f"starting checkpoints ready in {time.monotonic() - t0:.1f} s")
    return tuple(dataclasses.replace(size, ckpt=path) for (size, _), (path, _) in zip(jobs, built, strict=True))


def _build_checkpoint(size: Any, seed: int, device: str, cache_dir: str) -> tuple[str, bool]:
    import torch

    from rota_demo.llm_models import build_checkpoint

    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    return build_checkpoint(size, seed, device, cache_dir)


def prepare_demo(cfg: DemoConfig, progress: Callable[[str], None]) -> DemoConfig:
    """``cfg`` checked (:class:`HostMemoryShort` / ``DeviceMemoryShort`` for a run that won't fit, before anything
    is built) and with its LLM jobs' starting checkpoints, built where missing (the report reads how)."""
    cfg.check()
    host_memory_plan(cfg).check()
    check_device_fits(cfg)
    if cfg.llm_sizes and not all(s.ckpt for s in cfg.llm_sizes):
        cfg = dataclasses.replace(cfg, llm_sizes=starting_checkpoints(cfg, progress))
    return cfg


def run_demo(cfg: DemoConfig, progress: Callable[[str], None]) -> dict[str, ModeResult]:
    """:func:`prepare_demo`, then :func:`run_modes`: each requested mode's result."""
    return run_modes(prepare_demo(cfg, progress), progress)


def run_modes(cfg: DemoConfig, progress: Callable[[str], None]) -> dict[str, ModeResult]:
    """Run each requested mode of ``cfg`` (as :func:`prepare_demo` returned it) and return its result."""
    out: dict[str, ModeResult] = {}
    if "dedicated" in cfg.modes or "serial" in cfg.modes:
        progress(f"each job alone on its own {cfg.groups} device(s), one job after another (dedicated and serial)")
        alone = {}
        for job in JOBS:
            alone[job[0]] = _run_workers(worker_specs(cfg, (job,), None), progress, f"{job[0]} alone")
        setups = [setup for _, _, setup in alone.values()]
        if "dedicated" in cfg.modes:
            reports = {name: r for _, job_reports, _ in alone.values() for name, r in job_reports.items()}
            out["dedicated"] = ModeResult(
                "dedicated", max(span for span, _, _ in alone.values()), devices=cfg.groups * len(JOBS),
                reports=reports, job_spans={job: span for job, (span, _, _) in alone.items()}, setups=setups,
                how=(f"each job ran alone on its own {cfg.groups} device(s); dedicated makespan = the longest job "
                     f"alone, on {cfg.groups} devices per job ({cfg.groups * len(JOBS)} in all), as if every job had "
                     "its own devices at once"))
        if "serial" in cfg.modes:
            total, reports, spans = 0.0, {}, {}
            for job, (span, job_reports, _) in alone.items():
                for name, r in job_reports.items():  # lay the jobs end to end on one time axis (copies: dedicated
                    reports[name] = dataclasses.replace(  # keeps its own times), on the devices they share in turn
                        r, events=[(k, a + total, b + total) for k, a, b in r.events], start=total, end=r.end + total,
                        group=_group_of(name.rsplit("/", 1)[-1], cfg))
                spans[job] = span
                total += span
            out["serial"] = ModeResult("serial", total, devices=cfg.groups, reports=reports, job_spans=spans,
                                       how=f"the same runs end to end on {cfg.groups} device(s)", setups=setups)
    if "timesliced" in cfg.modes:
        shared = len(elastic_devices()) if cfg.elastic else cfg.groups
        where = f"one group over {shared} GPU(s)" if cfg.elastic else f"{cfg.groups} group(s)"
        progress(f"time-sliced: all jobs at once, taking turns through rota on {where}, {cfg.policy} policy")
        policy: Any = Priority() if cfg.policy == "priority" else Fifo()
        if cfg.resident_first_s:  # jobs that do not fit together wait for room instead of trading places
            policy = ResidentFirst(policy, patience_s=cfg.resident_first_s, capacity_bytes=cfg.capacity_bytes)
        config = OrchestratorConfig(ttl_s=60.0, park_timeout_s=600.0, capacity_bytes=cfg.capacity_bytes,
                                    policy=policy)
        key = secrets.token_bytes(auth.KEY_BYTES)  # credentials on, as in a shared cluster: each worker gets a
        with running_orchestrator(config, auth=auth.ServerAuth(key=key)) as (endpoint, engine):  # token for its job
            at_go: dict[str, tuple] = {}

            def counters() -> dict[str, tuple]:
                return {gid: (g.busy_seconds, g.switches, g.prefetch_hits, g.prefetch_misses, g.prefetch_failures,
                              g.prefetch_wasted) for gid, g in list(engine.groups.items())}

            specs = [dataclasses.replace(spec, token=auth.issue(key, group=spec.group, job=spec.tenant,
                                                                max_priority=max(spec.priority, 0)))
                     for spec in worker_specs(cfg, JOBS, endpoint)]
            span, reports, setup = _run_workers(specs, progress, "time-sliced",
                                                on_go=lambda: at_go.update(counters()))
            final = counters()
            delta = [tuple(a - b for a, b in zip(now, at_go.get(gid, (0,) * 6), strict=True))
                     for gid, now in final.items()]  # setup (before "go") is not part of the run
            prefetch = {k: int(sum(d[2 + i] for d in delta)) for i, k in enumerate(("hits", "misses", "failures",
                                                                                    "wasted"))}
            busy = {gid: d[0] for gid, d in zip(final, delta, strict=True) if d[0] > 0}
        out["timesliced"] = ModeResult(
            "timesliced", span, devices=shared, reports=reports, busy_seconds=sum(d[0] for d in delta),
            switches=int(sum(d[1] for d in delta)), prefetch=prefetch, busy_by_group=busy, setups=[setup],
            how=f"all jobs at once on {where}, taking turns through rota ({policy.name} policy)")
    return out
