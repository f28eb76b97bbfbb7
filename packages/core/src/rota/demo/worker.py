"""One demo worker process: the trainer or the sampler of one job.

Started by :mod:`rota.demo.runner` with the ``spawn`` method. With an orchestrator
endpoint, every device phase runs inside ``gpu.turn()`` on its group and the model
is tracked by whatever adapter is installed (``rota_fsdp``); without one, the
worker runs as if it had a dedicated device. Both paths execute the same math.

Weights go from trainer to sampler through the job's shared host buffer
(:mod:`rota.demo.push`): only a version number crosses the pipe. Tokens and rewards
(small) still go as ``torch.save`` bytes.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rota.demo.push import WeightPush, weights_digest
from rota.demo.workloads import ModelSize


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs; picklable for ``spawn``."""

    job: str
    kind: str  # "rl" | "sft"
    role: str  # "trainer" | "sampler"
    steps: int
    seed: int
    size: ModelSize
    device: str
    group: str
    endpoint: str | None = None  # None: dedicated device, no rota
    off_device_s: float = 0.1
    eval_every: int = 4
    record_digests: bool = False  # test hook: sha256 of the weights at every push, at both ends

    @property
    def name(self) -> str:
        return f"{self.job}/{self.role}"


@dataclass
class WorkerReport:
    """What a worker sends back when it finishes."""

    name: str
    values: list[float] = field(default_factory=list)  # losses (trainer) or rewards/eval losses (sampler)
    events: list[tuple[str, float, float]] = field(default_factory=list)
    parks: list[tuple[int, float]] = field(default_factory=list)  # (bytes, seconds)
    restores: list[tuple[int, float]] = field(default_factory=list)
    waits_ms: list[float] = field(default_factory=list)
    start: float = 0.0
    end: float = 0.0
    adapter: str = "none"
    state_bytes: int = 0
    pool_setup_s: float = 0.0
    digests: list[str] = field(default_factory=list)  # with spec.record_digests: one per push, in order


class _Device:
    """Device phases: a rota turn when shared, a plain block when dedicated."""

    def __init__(self, spec: WorkerSpec, report: WorkerReport) -> None:
        self.spec, self.report, self.gpu = spec, report, None
        if spec.endpoint:
            import rota

            self.gpu = rota.connect(group=spec.group, tenant=spec.name.replace("/", "-"), endpoint=spec.endpoint)

    def track(self, model: Any, opt: Any) -> None:
        if self.gpu is None:
            return
        try:
            import rota_fsdp
        except ImportError:  # no adapter installed: state stays resident, nothing is parked
            return
        tracked = rota_fsdp.track(self.gpu, model, opt)
        self.report.pool_setup_s = tracked.prepare()  # pin the host pool now, before the clock starts
        self.report.adapter = "rota_fsdp"

    @contextlib.contextmanager
    def phase(self) -> Iterator[None]:
        if self.gpu is None:
            t0 = time.monotonic()
            yield
            self.report.events.append(("turn", t0, time.monotonic()))
        else:
            with self.gpu.turn():
                yield

    @contextlib.contextmanager
    def off_device(self) -> Iterator[None]:
        t0 = time.monotonic()
        yield
        self.report.events.append(("off", t0, time.monotonic()))

    def close(self) -> None:
        if self.gpu is None:
            return
        stats = self.gpu.stats
        self.report.events += stats.events
        self.report.parks = [(p.bytes_moved, p.seconds) for p in stats.parks]
        self.report.restores = [(r.bytes_moved, r.seconds) for r in stats.restores]
        self.report.waits_ms = list(stats.waits_ms)
        self.gpu.close()


def worker_main(spec: WorkerSpec, inbox: Any, outbox: Any, results: Any, go: Any, push: WeightPush) -> None:
    """Process entry point: build, report ready, wait for go, run, report."""
    import torch

    torch.set_num_threads(1)
    if spec.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.cuda.set_device(torch.device(spec.device))
    from rota.demo import workloads as w

    report = WorkerReport(spec.name)
    trainer = spec.role == "trainer"
    model, opt = w.build(spec.size, spec.seed, spec.device, optimizer=trainer)
    if not trainer:  # a sampler never backpropagates: no grads, so its host pool holds the weights only
        model.requires_grad_(False)
    report.state_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) * (4 if trainer else 1)
    push.bind(model)
    dev = _Device(spec, report)
    if trainer:  # materialise grads and AdamW state before tracking, so every tensor exists
        _warm_optimizer(model, opt)
    dev.track(model, opt)
    results.put(("ready", spec.name, None))
    go.wait()
    report.start = time.monotonic()
    try:
        run = {("rl", "sampler"): _rl_sampler, ("rl", "trainer"): _rl_trainer,
               ("sft", "trainer"): _sft_trainer, ("sft", "sampler"): _sft_sampler}[(spec.kind, spec.role)]
        run(spec, model, opt, dev, inbox, outbox, results, push, report)
    finally:
        report.end = time.monotonic()
        dev.close()
    results.put(("done", spec.name, report))


def _warm_optimizer(model: Any, opt: Any) -> None:
    """Create grads and AdamW moments with a zero-lr step so parking sees all state;
    it changes no weight (lr 0, and weight decay scales by lr)."""
    import torch

    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = 0.0
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    for g, lr in zip(opt.param_groups, lrs, strict=True):
        g["lr"] = lr
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
    """Trainer, inside its turn (after ``push.claim()``): weights into the shared buffer."""
    push.write(model)
    if spec.record_digests:
        report.digests.append(weights_digest(model.state_dict()))


def _take(spec: WorkerSpec, model: Any, push: WeightPush, report: WorkerReport, version: int, expected: int) -> None:
    """Sampler, inside its turn: the announced push into the model's own tensors."""
    if version != expected:
        raise RuntimeError(f"{spec.name}: weight push {version} arrived, expected {expected} (pushes out of order)")
    push.read_into(model)
    if spec.record_digests:
        report.digests.append(weights_digest(model.state_dict()))


def _rl_sampler(spec, model, opt, dev, inbox, outbox, results, push, report) -> None:
    from rota.demo import workloads as w

    for step in range(spec.steps):
        version = inbox.recv() if step else None  # on-policy: wait for the trainer's update
        with dev.phase():
            if version is not None:
                _take(spec, model, push, report, version, step)
            tokens = w.generate(model, spec.size, spec.seed, step, spec.device).cpu()
        with dev.off_device():  # the environment / judge: real wall time, no device
            time.sleep(spec.off_device_s)
            rewards = w.reward(tokens, spec.size.vocab)
        report.values.append(float(rewards.mean()))
        _send(outbox, (tokens, rewards))


def _rl_trainer(spec, model, opt, dev, inbox, outbox, results, push, report) -> None:
    from rota.demo import workloads as w

    for step in range(spec.steps):
        tokens, rewards = _recv(inbox)
        pushing = step + 1 < spec.steps
        if pushing:
            push.claim()  # before the turn: the sampler has read the last push (it sent these tokens after)
        with dev.phase():
            loss = w.reinforce_step(model, opt, tokens.to(spec.device), rewards.to(spec.device))
            if pushing:
                _publish(spec, model, push, report)
        report.values.append(loss)
        results.put(("progress", spec.name, (step, loss)))
        if pushing:
            outbox.send(step + 1)  # only the version number crosses the pipe


def _sft_trainer(spec, model, opt, dev, inbox, outbox, results, push, report) -> None:
    from rota.demo import workloads as w

    for step in range(spec.steps):
        with dev.off_device():  # the data loader: host work
            time.sleep(spec.off_device_s)
            x, y = w.sft_batch(spec.size, spec.seed, step)
        pushing = (step + 1) % spec.eval_every == 0
        if pushing:
            push.claim()  # before the turn: waits only if the eval sampler still reads the previous push
        with dev.phase():
            loss = w.sft_step(model, opt, x.to(spec.device), y.to(spec.device))
            if pushing:
                _publish(spec, model, push, report)
        report.values.append(loss)
        results.put(("progress", spec.name, (step, loss)))
        if pushing:
            outbox.send((step + 1) // spec.eval_every)


def _sft_sampler(spec, model, opt, dev, inbox, outbox, results, push, report) -> None:
    from rota.demo import workloads as w

    x, y = w.sft_batch(spec.size, spec.seed + 1, 10_000)  # held-out batch
    for i in range(spec.steps // spec.eval_every):
        version = inbox.recv()
        with dev.phase():
            _take(spec, model, push, report, version, i + 1)
            report.values.append(w.eval_loss(model, x.to(spec.device), y.to(spec.device)))
