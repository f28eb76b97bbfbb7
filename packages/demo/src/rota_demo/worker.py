"""One demo worker process: the trainer or the sampler of one job.

Started by :mod:`rota_demo.runner` from a ``forkserver`` that imported torch and rota (vLLM jobs: ``spawn``;
no CUDA before the worker's own). With an orchestrator
endpoint, every device phase runs inside ``gpu.turn()`` on its group and the model
is tracked by ``rota_fsdp`` (a dependency of rota-demo); without an endpoint, the
worker runs as if it had a dedicated device. Both paths execute the same math.

Weights go from trainer to sampler through the job's shared host buffer
(:mod:`rota_demo.push`): only a version number crosses the pipe. Tokens and rewards
(small) still go as ``torch.save`` bytes.

Setup happens before the runner's "go", in every mode alike, so no mode's clock pays
for it: build the model, warm it up (a zero-learning-rate step through the job's own
step function, or one generation: cuBLAS handles, kernels, the allocator's first
blocks, the optimizer's state), pin the push buffer and the host pool. With rota the
build and warm-up run inside a turn, so tenants whose states do not fit on the device
together are built one at a time (the orchestrator parks the earlier ones).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rota_demo.push import WeightPush, weights_digest

__all__ = ["DeviceTurns", "ToyWork", "WorkerReport", "WorkerSpec", "free_device_state", "step_at_zero_lr",
           "worker_main"]


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; picklable (the worker gets it through ``forkserver`` or ``spawn``)."""

    job: str
    kind: str  # "rl" | "sft"
    role: str  # "trainer" | "sampler"
    steps: int
    seed: int
    size: Any  # ModelSize (--engine toy) or rota_demo.llm_models.LlmSize (--engine hf|vllm)
    device: str  # where it starts (with devices: the first; each turn's device is the grant's)
    group: str
    endpoint: str | None = None  # None: dedicated device, no rota
    devices: tuple[str, ...] = ()  # a group over several devices (--elastic): rota places each turn
    off_device_s: float = 0.1
    eval_every: int = 4
    record_digests: bool = False  # test hook: sha256 of the weights at every push, at both ends
    priority: int = 0  # under the priority policy, higher runs first
    token: str = ""  # proves to the orchestrator that this worker may act for its job (rota.auth)
    prepare_pool: bool = True  # pin the host pool during setup (False: it grows at a first park, if any)
    sft_turns: int = 1  # SFT trainer: microbatches per step, each in its own turn (the last also updates)
    engine: str = "toy"  # toy: rota's own small models and sampler; hf | vllm: rota_demo.llm_worker's jobs
    footprint_hint: int = 0  # device bytes it will hold, told to rota before it builds (0: the size's own figure)

    @property
    def name(self) -> str:
        return f"{self.job}/{self.role}"

    @property
    def tenant(self) -> str:
        """Its job id in the orchestrator (one per worker: trainer and sampler take turns on different groups)."""
        return self.name.replace("/", "-")


@dataclass
class WorkerReport:
    """What a worker sends back when it finishes."""

    name: str
    values: list[float] = field(default_factory=list)  # losses (trainer) or rewards/eval losses (sampler)
    events: list[tuple[str, float, float]] = field(default_factory=list)
    parks: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    restores: list[tuple[int, float]] = field(default_factory=list)
    moves: list[tuple[int, float]] = field(default_factory=list)  # resident state moved device to device
    waits_ms: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    adapter: str = "none"
    state_bytes: int = 0
    pool_setup_s: float = 0.0
    push_pin_s: float = 0.0
    push_pinned: bool = False
    digests: list[str] = field(default_factory=list)  # with spec.record_digests: one per push, in order
    group: str = ""  # the rota group (shared device) it took turns on; "" = a device of its own
    # parks and restores of this worker that failed, setup included: ("park" | "restore", "Type: message")
    failures: list[tuple[str, str]] = field(default_factory=list)
    # the largest footprint it reported at a turn's end (tag -> bytes: tracked state, working set, an engine's
    # share), what the orchestrator counts against its capacity: with the others', what fits and what must park
    footprint: dict[str, int] = field(default_factory=dict)


class DeviceTurns:
    """Device phases: a rota turn when shared, a plain block when dedicated."""

    def __init__(self, spec: WorkerSpec, report: WorkerReport) -> None:
        self.spec, self.report, self.gpu, self.tracked = spec, report, None, None
        self.working: Any = None  # rota_torch.WorkingSet once tracked on one CUDA device
        self._counts = (0, 0, 0, 0, 0)
        if spec.endpoint:
            import rota

            need = spec.footprint_hint or (spec.size.trainer_state_bytes if spec.role == "trainer"
                                           else spec.size.weight_bytes)
            self.gpu = rota.connect(group=spec.group, tenant=spec.tenant, endpoint=spec.endpoint,
                                    priority=spec.priority, footprint_hint=need, token=spec.token,
                                    devices=list(spec.devices) or None)

    @property
    def device(self) -> str:
        """The device of this turn (the grant's, in a group over several devices), else the worker's own."""
        return (self.gpu.device if self.gpu is not None else None) or self.spec.device

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        """Building and warming up: inside a turn with rota (one tenant on the device at a time); a quiet one
        for a vLLM engine, which profiles the device's free memory as it starts (no prefetch may change it)."""
        if self.gpu is None:
            yield
        else:
            with self.gpu.turn(quiet=self.spec.engine == "vllm" and self.spec.role == "sampler"):
                self._on_turn_device()
                yield
                self._turn_ended()

    def track(self, model: Any, opt: Any) -> None:
        """Inside :meth:`setup`: make a torch model's state parkable (the host pool starts filling in the
        background)."""
        if self.gpu is None:
            return
        import rota_fsdp

        self.tracked = rota_fsdp.track(self.gpu, model, opt, pool_bytes=None if self.spec.prepare_pool else 0)
        self.report.adapter = "rota_fsdp"
        if str(self.device).startswith("cuda") and not self.spec.devices:
            # its steps' activations and bf16 weight copies count against the capacity too (a group over several
            # devices is left out: its peak counters are per device, and the turn's device changes)
            import torch

            import rota_torch

            self.working = rota_torch.WorkingSet(self.gpu, torch.device(self.device))

    def prepare(self) -> None:
        """After :meth:`setup`, off the device: wait for the host pool to be pinned, before the clock starts."""
        if self.tracked is not None and self.spec.prepare_pool:
            self.report.pool_setup_s = self.tracked.prepare()

    def started(self) -> None:
        """The clock starts: what the client recorded during setup is not part of the run."""
        if self.gpu is not None:
            st = self.gpu.stats
            self._counts = (st.events.total, st.parks.total, st.restores.total, st.waits_ms.total, st.moves.total)

    @contextlib.contextmanager
    def phase(self, after: Any = None) -> Iterator[None]:
        """A device phase; ``after`` (copies out of device state) runs once the turn is given back."""
        if self.gpu is None:
            t0 = time.monotonic()
            yield
            t1 = time.monotonic()
            self.report.events.append(("turn", t0, t1))
            if after is not None:
                after()
                self.report.events.append(("after", t1, time.monotonic()))
        else:
            with self.gpu.turn(after=after):
                self._on_turn_device()
                yield
                self._turn_ended()

    def _turn_ended(self) -> None:
        """Inside the turn, before its release: the turn's peak beyond the tracked state, for the footprint that
        the release and later acquires report (see :class:`rota_torch.WorkingSet`); the largest footprint so far,
        for the report."""
        now = self.working.turn_ended() if self.working is not None else None
        if self.gpu is not None:
            now = now if now is not None else self.gpu.footprint()  # the working set's read, else one of our own
            if sum(now.values()) > sum(self.report.footprint.values()):
                self.report.footprint = now

    def _on_turn_device(self) -> None:
        """The turn's device is the current one (a turn of a group over several GPUs may be on another)."""
        if self.spec.devices:
            import torch

            torch.cuda.set_device(torch.device(self.device))

    @contextlib.contextmanager
    def off_device(self) -> Iterator[None]:
        t0 = time.monotonic()
        yield
        self.report.events.append(("off", t0, time.monotonic()))

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Between turns: no park or restore of this worker's state runs inside the block (rota's ``hold_state``)."""
        if self.gpu is None:
            yield
        else:
            with self.gpu.hold_state():
                yield

    def discard(self, tags: frozenset[str]) -> None:
        """At the run's end, between turns: park the tracked state through rota dropping ``tags`` instead of
        copying them. Why through rota: state freed behind the adapter's back (a vLLM engine put to sleep by
        ``LLM.sleep``) was still awake to it, and a park the orchestrator asked for next copied from unmapped
        memory and failed (the h100 shapes at 6ca51d2: "CUDA error: invalid argument"); a parked tenant's later
        parks move nothing."""
        if self.gpu is None:
            return
        from rota import ParkPlan

        self.gpu.park(ParkPlan(discard=tags))

    def close(self) -> None:
        """End the session, then report what the client saw: a park the orchestrator asked for as the run ended
        finishes before the session does, so its failure is counted (read before the end, one that failed there was
        left out of the result). Parks after the run's end (``report.end``: freeing, :meth:`discard`, a park of
        what was freed) are its clean-up, not its switches: left out of the parks and events."""
        if self.gpu is None:
            return
        self.gpu.close()
        stats = self.gpu.stats
        self.report.failures = [(kind, why) for kind, _, why in list(stats.failures)]
        events, parks, restores, waits, moves = self._counts
        end = self.report.end or float("inf")
        new = stats.events.since(events)[0]
        self.report.events += [ev for ev in new if ev[1] < end]
        late = sum(1 for kind, start, _ in new if kind == "park" and start >= end)  # the last parks, in order
        kept = stats.parks.since(parks)[0]
        self.report.parks = [(p.bytes_moved, p.seconds) for p in kept[:max(0, len(kept) - late)]]
        self.report.restores = [(r.bytes_moved, r.seconds) for r in stats.restores.since(restores)[0]]
        self.report.moves = [(m.bytes_moved, m.seconds) for m in stats.moves.since(moves)[0]]
        self.report.waits_ms = list(stats.waits_ms.since(waits)[0])


class ToyWork:
    """The math of ``--engine toy`` (rota's own small models and sampler, :mod:`rota_demo.workloads`), as the
    loops below call it; :class:`rota_demo.llm_worker.LlmWork` is the LLM mode's."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec

    def setup(self, dev: DeviceTurns, report: WorkerReport) -> tuple[Any, Any]:
        """Inside ``dev.setup()``: (model, optimizer or None), warmed up and tracked."""
        from rota_demo import workloads as w

        spec, trainer = self.spec, self.spec.role == "trainer"
        model, opt = w.build(spec.size, spec.seed, dev.device, optimizer=trainer)
        if not trainer:  # a sampler never backpropagates: no grads, so its host pool holds the weights only
            model.requires_grad_(False)
        report.state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * (4 if trainer else 1)
        _warm_up(spec, model, opt, dev.device)  # every tensor exists before tracking; first-call costs paid here
        dev.track(model, opt)
        return model, opt

    def push_target(self, model: Any) -> Any:
        return model

    def free(self, model: Any, opt: Any, dev: DeviceTurns) -> None:
        """At the end of the run: give the job's device memory back, with the state held."""
        with dev.holding():
            free_device_state(model, opt)

    def take(self, model: Any, push: WeightPush) -> Any:
        """Inside the sampler's turn: the announced push into its weights; returns what to digest, or None."""
        push.read_into(model)
        return model

    def rollout(self, model: Any, step: int, device: str) -> Any:
        from rota_demo import workloads as w

        return w.generate(model, self.spec.size, self.spec.seed, step, device).cpu()

    def judge(self, rollout: Any, step: int) -> tuple[Any, float]:
        """Off the device: (what the trainer gets, the step's mean reward)."""
        from rota_demo import workloads as w

        rewards = w.reward(rollout, self.spec.size.vocab)
        return (rollout, rewards), float(rewards.mean())

    def rl_step(self, model: Any, opt: Any, payload: Any, device: str) -> float:
        from rota_demo import workloads as w

        tokens, rewards = payload
        return w.reinforce_step(model, opt, tokens.to(device), rewards.to(device))

    def sft_data(self, step: int) -> Any:
        from rota_demo import workloads as w

        return w.sft_batch(self.spec.size, self.spec.seed, step)

    def sft_step(self, model: Any, opt: Any, data: Any, turn: Any) -> float:
        from rota_demo import workloads as w

        x, y = data
        return w.sft_step(model, opt, x, y, self.spec.sft_turns, turn=turn)  # each microbatch to its turn's device

    def held_out(self) -> Any:
        from rota_demo import workloads as w

        return w.sft_batch(self.spec.size, self.spec.seed + 1, 10_000)

    def evaluate(self, model: Any, held: Any, device: str) -> float:
        from rota_demo import workloads as w

        x, y = held
        return w.eval_loss(model, x.to(device), y.to(device))


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any, results: Any, go: Any, push: WeightPush,
                finish: Any = None, build: Any = None) -> None:
    """Process entry point (:func:`_serve`). A worker that raises tells the parent why before its process ends
    (``("failed", name, "Type: message")``), so the run stops naming the worker that failed and its error, not
    the first of the workers that died after it (its peer, whose pipe closed)."""
    try:
        _serve(spec, inbox, outbox, results, go, push, finish, build)
    except Exception as e:
        results.put(("failed", spec.name, f"{type(e).__name__}: {e}"[:1000]))
        raise


def _serve(spec: WorkerSpec, inbox: Any, outbox: Any, results: Any, go: Any, push: WeightPush,
           finish: Any = None, build: Any = None) -> None:
    """Build, report ready, wait for go, run, report, then wait for ``finish`` to exit.

    ``build`` (an event): wait for it before building the job's state, once torch is imported and the
    device's context made: the parent starts every worker at once and lets them build in turn.

    Why wait: a process that exits unregisters its pinned host pools and destroys its CUDA
    context, which stalled the other tenants' CUDA calls on that device for seconds (60 GB
    tenants on an H200). The run ends at the last report, as each job alone does; exits come after.
    Ctrl-C is the parent's: it stops the workers (a worker's own KeyboardInterrupt would print a traceback).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    marks = {"entered": time.monotonic()}  # set-up milestones (CLOCK_MONOTONIC: the parent's clock too)
    import torch

    torch.set_num_threads(1)
    marks["torch"] = time.monotonic()  # instant where the process already has torch (a forkserver child)
    if spec.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if spec.engine != "vllm" or spec.role == "trainer":  # vLLM's kernels are its own; its samples are seeded
            torch.use_deterministic_algorithms(True)
        torch.cuda.set_device(torch.device(spec.device))
        marks["device"] = time.monotonic()
        # the CUDA context now, while other workers build (toy jobs only: a vLLM engine's start-up profiles the
        # device's memory and wants it to itself)
        if spec.engine == "toy":
            torch.cuda.synchronize()
    marks["context"] = time.monotonic()
    if spec.engine != "toy":  # the LLM mode's heavy imports now, while others build: not inside this job's turn
        from rota_demo.llm_engines import preload

        preload(spec.engine, spec.role)
    marks["imported"] = time.monotonic()
    pinning = _pin_while_building(push, spec.device) if spec.engine == "toy" else None
    if build is not None:
        build.wait()
    marks["build"] = time.monotonic()
    if spec.engine == "toy":
        work: Any = ToyWork(spec)
    else:
        from rota_demo.llm_worker import LlmWork

        work = LlmWork(spec)
    report = WorkerReport(spec.name, group=spec.group if spec.endpoint else "")
    dev = DeviceTurns(spec, report)
    with dev.setup():
        model, opt = work.setup(dev, report)
    marks["built"] = time.monotonic()
    push.bind(work.push_target(model))
    report.push_pin_s = (pinning.result() if pinning is not None else 0.0) + push.pin()
    report.push_pinned = push.pinned
    marks["push_pinned"] = time.monotonic()
    dev.prepare()
    marks["ready"] = time.monotonic()
    results.put(("ready", spec.name, marks))
    go.wait()
    report.start = time.monotonic()
    dev.started()
    try:
        run = {("rl", "sampler"): _rl_sampler, ("rl", "trainer"): _rl_trainer,
               ("sft", "trainer"): _sft_trainer, ("sft", "sampler"): _sft_sampler}[(spec.kind, spec.role)]
        run(spec, work, model, opt, dev, inbox, outbox, results, push, report)
    finally:
        report.end = time.monotonic()
        work.free(model, opt, dev)  # with the state held, or as a park through rota: no park copies freed memory
        dev.close()
    results.put(("done", spec.name, report))
    if finish is not None:
        finish.wait(timeout=3600)


def _pin_while_building(push: WeightPush, device: str) -> Any:
    """Pin the push buffer in a thread of its own (a future of its seconds): seconds of page faults that run while
    this worker waits for its turn to build and builds, instead of after (up to 3.5 s for a 20 GB job's buffer on
    the H100, on every start's critical path)."""
    from concurrent.futures import ThreadPoolExecutor

    def pin() -> float:
        import torch

        if device.startswith("cuda"):  # the thread's current device: the one the copies use (CPU: nothing to pin)
            torch.cuda.set_device(torch.device(device))
        return push.pin(device)

    pool = ThreadPoolExecutor(1, thread_name_prefix="push-pin")
    future = pool.submit(pin)
    pool.shutdown(wait=False)  # takes no more work; the pin runs on
    return future


def free_device_state(model: Any, opt: Any) -> None:
    """At the end of the run, give the job's device memory back to the driver before its session ends.

    Why: a process's memory otherwise goes only when it exits, seconds later with tens of
    GB of pinned host pools to unregister, and the job granted next (told that this one
    ended) would wait for room meanwhile. The caller holds the state (``gpu.hold_state()``):
    a park that ran concurrently once copied storages this freed and failed.
    """
    import torch

    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None)]
    if opt is not None:
        tensors += [v for state in opt.state.values() for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        if t.is_cuda:
            t.untyped_storage().resize_(0)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _warm_up(spec: WorkerSpec, model: Any, opt: Any, device: str) -> None:
    """Run the worker's own device work once, changing nothing it will compute later.

    A trainer takes one step of its own kind on an all-zero batch at learning rate 0
    (weight decay scales by the learning rate, so no weight moves), then its grads and
    AdamW moments and step counts are zeroed: the state a fresh optimizer would have,
    but every tensor exists (so parking sees all of it) and cuBLAS, the kernels and the
    allocator are warm. A sampler generates once (its own generator: no global RNG is
    used) or evaluates once, without gradients.
    """
    import torch

    from rota_demo import workloads as w

    size = spec.size
    zeros = torch.zeros(size.batch, size.seq, dtype=torch.long, device=device)
    if spec.role == "sampler":
        if spec.kind == "rl":
            w.generate(model, size, spec.seed, 10**6, device)
        else:
            w.eval_loss(model, zeros, zeros)
        return
    if spec.kind == "rl":
        step_at_zero_lr(model, opt, lambda: w.reinforce_step(model, opt, zeros, torch.zeros(size.batch,
                                                                                             device=device)))
    else:
        step_at_zero_lr(model, opt, lambda: w.sft_step(model, opt, zeros, zeros, spec.sft_turns))


def step_at_zero_lr(model: Any, opt: Any, step: Any) -> None:
    """Run ``step()`` (one optimizer step of the job's own kind) at learning rate 0, then zero the grads, the
    AdamW moments and step counts: the state a fresh optimizer would have, but every tensor exists (so parking
    sees all of it) and the kernels and the allocator are warm. Weight decay scales by the learning rate, so
    no weight moves."""
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
    for p in model.parameters():
        p.grad.zero_()
    for state in opt.state.values():  # start from the same moments a fresh optimizer would have
        for key, value in state.items():
            if key != "step" and hasattr(value, "zero_"):
                value.zero_()
        if "step" in state:
            state["step"].zero_()


def _send(conn: Any, obj: Any) -> None:
    """Send (small) tensors as bytes: torch's shared-memory pickling dies with the sender."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    conn.send_bytes(buf.getvalue())


def _recv(conn: Any) -> Any:
    import io

    import torch

    return torch.load(io.BytesIO(conn.recv_bytes()), weights_only=True)


def _publish(spec: WorkerSpec, model: Any, push: WeightPush, report: WorkerReport) -> None:
    """Trainer, right after its turn with its state still on the device (after ``push.claim()``): weights into
    the shared buffer. Only the copy engine works, while the next trainer's turn computes."""
    push.write(model)
    if spec.record_digests:
        report.digests.append(weights_digest(model.state_dict()))


def _take(spec: WorkerSpec, work: Any, model: Any, push: WeightPush, report: WorkerReport, version: int,
          expected: int) -> None:
    """Sampler, inside its turn: the announced push into the model's (or engine's) own tensors."""
    if version != expected:
        raise RuntimeError(f"{spec.name}: weight push {version} arrived, expected {expected} (pushes out of order)")
    target = work.take(model, push)
    if spec.record_digests and target is not None:
        report.digests.append(weights_digest(target.state_dict()))


def _rl_sampler(spec, work, model, opt, dev, inbox, outbox, results, push, report) -> None:
    for step in range(spec.steps):
        version = inbox.recv() if step else None  # on-policy: wait for the trainer's update
        with dev.phase():
            if version is not None:
                _take(spec, work, model, push, report, version, step)
            rollout = work.rollout(model, step, dev.device)
        with dev.off_device():  # the environment / judge: real wall time, no device
            time.sleep(spec.off_device_s)
            payload, mean_reward = work.judge(rollout, step)
        report.values.append(mean_reward)
        _send(outbox, payload)


def _rl_trainer(spec, work, model, opt, dev, inbox, outbox, results, push, report) -> None:
    for step in range(spec.steps):
        payload = _recv(inbox)
        pushing = step + 1 < spec.steps
        if pushing:
            push.claim()  # before the turn: the sampler has read the last push (it sent these tokens after)
        publish = (lambda: _publish(spec, model, push, report)) if pushing else None
        with dev.phase(after=publish):  # the push copies run while the next trainer computes
            loss = work.rl_step(model, opt, payload, dev.device)
        report.values.append(loss)
        results.put(("progress", spec.name, (step, loss)))
        if pushing:
            outbox.send(step + 1)  # only the version number crosses the pipe


def _sft_trainer(spec, work, model, opt, dev, inbox, outbox, results, push, report) -> None:
    for step in range(spec.steps):
        with dev.off_device():  # the data loader: host work
            time.sleep(spec.off_device_s)
            data = work.sft_data(step)
        pushing = (step + 1) % spec.eval_every == 0
        if pushing:
            push.claim()  # before the turn: waits only if the eval sampler still reads the previous push
        publish = (lambda: _publish(spec, model, push, report)) if pushing else None
        # a turn per microbatch: a waiting RL job waits one microbatch at most
        loss = work.sft_step(model, opt, data,
                             lambda last, publish=publish: dev.phase(after=publish if last else None))
        report.values.append(loss)
        results.put(("progress", spec.name, (step, loss)))
        if pushing:
            outbox.send((step + 1) // spec.eval_every)


def _sft_sampler(spec, work, model, opt, dev, inbox, outbox, results, push, report) -> None:
    held = work.held_out()
    for i in range(spec.steps // spec.eval_every):
        version = inbox.recv()
        with dev.phase():
            _take(spec, work, model, push, report, version, i + 1)
            report.values.append(work.evaluate(model, held, dev.device))
