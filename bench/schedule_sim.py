"""The demo's h200 and h100 shapes under rota's real policy, simulated: which engine shares and policy to spend GPU
time on.

A model, not a measurement. The six workers of ``rota demo --engine vllm --llm-size h200 --groups 1`` (two RL jobs
and an SFT job, each a trainer and a vLLM engine; ``--shapes h100`` for ``--llm-size h100``) take turns through a
real orchestrator (the embedded one, over loopback gRPC, with its capacity, prefetch and policy as the demo
configures them), but their device work is a sleep of the length measured on the card (h200: at 30372e5,
``bench/results/demo-vllm-h200-auto-30372e5.*``, the runs alone took 14.9, 18.5 and 22.2 s for 12 steps; h100: at
e7b3197, ``demo-vllm-h100-auto-e7b3197.*``, 14.7, 18.0 and 16.5 s), and their state is a fake: it parks and
restores by sleeping its bytes over ``--gbps``, and reports as its footprint what that run's workers counted
(trainer state plus working set, estimated for h200, as the summary printed them for h100; an engine's share of
the device plus 1.5 GiB). Everything runs ``--speed`` times faster than real and is reported back in real
seconds. What it predicts is what the orchestrator's choices cost (parks, restores, waits) for a given set of
footprints; what it cannot see: the host's own contention, vLLM's wake-ups beyond the copy, the weight pushes,
the steps' real variance.

Per configuration (``--configs``: ``shares/policy`` pairs, e.g. ``0.10,0.12,0.20/priority``): the time-sliced
makespan over the serial one (the jobs' spans alone, added), parks and restores per worker, bytes moved.

    python bench/schedule_sim.py --configs "0.10,0.12,0.20/priority;0.05,0.05,0.20/priority" --out \\
        bench/results/schedule-sim-h200.json
    python bench/schedule_sim.py --shapes h100 --configs "0.10,0.12,0.12/priority;0.05,0.05,0.12/resident-first"
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import rota
from rota.orchestrator import OrchestratorConfig
from rota.policies import Priority, ResidentFirst
from rota.testing import running_orchestrator

GIB = 1 << 30


@dataclass
class Job:
    """One job of the demo: its trainer's state and working set, its engine's weights, and its step's timings."""

    name: str
    kind: str  # rl | sft
    state_gib: float
    working_gib: float  # the step's peak beyond the state (an estimate: bf16 weight copies and activations)
    weights_gib: float  # the engine's bf16 weights, which a park moves
    share: float  # the engine's gpu_memory_utilization
    turn_s: dict[str, float] = field(default_factory=dict)  # device seconds: gen (RL), train, eval (SFT)
    off_s: float = 0.6  # off the device per step: reward (RL), data (SFT)

    def span(self, steps: int, evals: int) -> float:
        t = self.turn_s
        if self.kind == "rl":
            return steps * (t["gen"] + self.off_s + t["train"])
        return steps * (t["train"] + self.off_s) + evals * t["eval"]


@dataclass(frozen=True)
class Shapes:
    """One ``--llm-size`` preset on its card: the jobs, the device as torch reports it, ``--capacity auto`` there."""

    jobs: tuple[Job, ...]
    device_bytes: float
    capacity_bytes: int
    preset: str  # the preset's engine shares under the demo's default policy, as --configs takes them


SHAPES = {
    #: timings fitted to the H200 run's spans alone at 30372e5 (14.9, 18.5, 22.2 s for 12 steps); working sets
    #: estimated (that run's summary did not report them yet)
    "h200": Shapes((Job("rl-a", "rl", 6.6, 1.5, 0.8, 0.10, {"gen": 0.40, "train": 0.24}),
                    Job("rl-b", "rl", 21.0, 7.4, 2.6, 0.12, {"gen": 0.55, "train": 0.39}),
                    Job("sft", "sft", 54.1, 8.0, 6.8, 0.20, {"train": 1.10, "eval": 1.9}, off_s=0.25)),
                   139.8 * GIB, int(125.8 * GIB), "0.10,0.12,0.20/priority"),
    #: states and working sets as the H100 run at e7b3197 counted them (its footprint line); timings fitted to
    #: its spans alone (14.7, 18.0, 16.5 s), each job's split between turns taken from the h200 fit
    "h100": Shapes((Job("rl-a", "rl", 6.56, 6.09, 0.82, 0.10, {"gen": 0.39, "train": 0.235}),
                    Job("rl-b", "rl", 21.0, 10.97, 2.6, 0.12, {"gen": 0.53, "train": 0.37}),
                    Job("sft", "sft", 30.08, 6.23, 3.76, 0.12, {"train": 0.786, "eval": 1.36}, off_s=0.25)),
                   79.2 * GIB, int(71.2 * GIB), "0.10,0.12,0.12/priority"),
}


class SleepState:
    """A fake tenant state: parks and restores by sleeping ``move_bytes`` over the bandwidth; reports
    ``footprint`` bytes (what the orchestrator counts), resident or not, as rota_torch does."""

    def __init__(self, gpu: Any, footprint: int, move_bytes: int, gbps: float, speed: float) -> None:
        self.gpu, self.footprint, self.move_bytes = gpu, footprint, move_bytes
        self.move_s = move_bytes / (gbps * 1e9) / speed
        self.parked, self.parks, self.restores = False, 0, 0
        gpu.pm.register(self, name=f"sleep-state-{gpu.tenant}-{id(self)}")  # the process's manager: see simulate

    @rota.hookimpl
    def rota_park(self, tenant: Any, plan: Any) -> Any:
        if tenant is not self.gpu or self.parked:
            return None
        time.sleep(self.move_s)
        self.parked, self.parks = True, self.parks + 1
        return rota.ParkResult(bytes_moved=self.move_bytes, seconds=self.move_s)

    @rota.hookimpl
    def rota_restore(self, tenant: Any, plan: Any) -> Any:
        if tenant is not self.gpu or not self.parked:
            return None
        time.sleep(self.move_s)
        self.parked, self.restores = False, self.restores + 1
        return rota.ParkResult(bytes_moved=self.move_bytes, seconds=self.move_s)

    @rota.hookimpl
    def rota_footprint(self, tenant: Any) -> Any:
        return {"state": self.footprint} if tenant is self.gpu else None


def _run_job(job: Job, gpus: dict[str, Any], steps: int, evals_every: int, speed: float,
             ends: dict[str, float], t0: float) -> None:
    def on_device(role: str, seconds: float) -> None:
        with gpus[role].turn():
            time.sleep(seconds / speed)

    for step in range(steps):
        if job.kind == "rl":
            on_device("sampler", job.turn_s["gen"])
            time.sleep(job.off_s / speed)
            on_device("trainer", job.turn_s["train"])
        else:
            on_device("trainer", job.turn_s["train"])
            time.sleep(job.off_s / speed)
            if (step + 1) % evals_every == 0:
                on_device("sampler", job.turn_s["eval"])
    ends[job.name] = (time.monotonic() - t0) * speed
    for gpu in gpus.values():  # a job that is done leaves, as the demo's workers do: its state holds no room
        gpu.close()


def simulate(shapes: Shapes, shares: tuple[float, ...], policy: str, *, steps: int, evals_every: int, gbps: float,
             speed: float, patience_s: float) -> dict[str, Any]:
    jobs, capacity = shapes.jobs, shapes.capacity_bytes
    base = Priority()
    # its times in the model's clock: patience, and the switch rate it assumes until parks are measured (measured
    # ones already run --speed times faster)
    chosen: Any = ResidentFirst(base, patience_s=patience_s / speed, capacity_bytes=capacity,
                                switch_bytes_per_s=ResidentFirst.switch_bytes_per_s * speed) \
        if policy == "resident-first" else base
    config = OrchestratorConfig(ttl_s=60.0, park_timeout_s=600.0, capacity_bytes=capacity, policy=chosen)
    ends: dict[str, float] = {}
    states: dict[str, SleepState] = {}
    with running_orchestrator(config) as (endpoint, _orch):
        gpus_by_job: dict[str, dict[str, Any]] = {}
        for job, share in zip(jobs, shares, strict=True):
            prio = 1 if job.kind == "rl" else 0
            roles = {"trainer": (int((job.state_gib + job.working_gib) * GIB), int(job.state_gib * GIB)),
                     "sampler": (int(share * shapes.device_bytes + 1.5 * GIB), int(job.weights_gib * GIB))}
            gpus_by_job[job.name] = {}
            for role, (footprint, moved) in roles.items():
                name = f"{job.name}-{role}"
                gpu = rota.connect(group="gpu0", tenant=name, endpoint=endpoint, priority=prio,
                                   footprint_hint=footprint)
                states[f"{job.name}/{role}"] = SleepState(gpu, footprint, moved, gbps, speed)
                gpus_by_job[job.name][role] = gpu
        t0 = time.monotonic()
        threads = [threading.Thread(target=_run_job, args=(job, gpus_by_job[job.name], steps, evals_every, speed,
                                                           ends, t0)) for job in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if len(ends) != len(jobs):  # a job's thread died (its traceback is above): no makespan to report
            raise RuntimeError(f"jobs {sorted({j.name for j in jobs} - set(ends))} did not finish")
        for state in states.values():
            state.gpu.pm.unregister(state)
    evals = steps // evals_every
    serial = sum(job.span(steps, evals) for job in jobs)
    makespan = max(ends.values())
    footprints = {name: s.footprint for name, s in states.items()}
    return {"shares": list(shares), "policy": policy, "makespan_s": makespan, "serial_s": serial,
            "timesliced_over_serial": makespan / serial, "job_ends_s": ends,
            "parks": {n: s.parks for n, s in states.items()}, "restores": {n: s.restores for n, s in states.items()},
            "bytes_moved": sum((s.parks + s.restores) * s.move_bytes for s in states.values()),
            "footprints_bytes": footprints, "footprints_total_bytes": sum(footprints.values()),
            "capacity_bytes": capacity}


def _config(text: str) -> tuple[tuple[float, ...], str]:
    shares, _, policy = text.partition("/")
    try:
        values = tuple(float(x) for x in shares.split(","))
    except ValueError:
        values = ()
    if len(values) != 3 or not all(0 < v < 1 for v in values) or policy not in ("priority", "resident-first"):
        raise argparse.ArgumentTypeError(f"{text!r}: want three shares in (0, 1) and a policy, "
                                         "e.g. 0.10,0.12,0.20/priority or 0.05,0.05,0.20/resident-first")
    return values, policy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", choices=sorted(SHAPES), default="h200", help="the demo's --llm-size (default h200)")
    p.add_argument("--configs", type=lambda s: [_config(c) for c in s.split(";")], default=None,
                   help="';'-separated shares/policy pairs (default: the preset's shares under the priority policy)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--evals-every", type=int, default=4, help="SFT steps between evaluations (default 4)")
    p.add_argument("--gbps", type=float, default=50.0, help="park/restore bandwidth, GB/s (default 50)")
    p.add_argument("--speed", type=float, default=4.0, help="simulated seconds per real second (default 4)")
    p.add_argument("--patience", type=float, default=60.0, help="resident-first's patience, seconds (default 60)")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.steps < 1 or args.evals_every < 1 or args.gbps <= 0 or args.speed <= 0 or args.patience < 0:
        p.error("--steps and --evals-every must be at least 1, --gbps and --speed above 0, --patience >= 0")
    shapes, rows = SHAPES[args.shapes], []
    for shares, policy in args.configs or [_config(SHAPES[args.shapes].preset)]:
        row = simulate(shapes, shares, policy, steps=args.steps, evals_every=args.evals_every, gbps=args.gbps,
                       speed=args.speed, patience_s=args.patience)
        rows.append(row)
        print(f"shares {','.join(f'{s:.2f}' for s in shares)} {policy:<14} time-sliced {row['makespan_s']:6.1f} s / "
              f"serial {row['serial_s']:.1f} s = {row['timesliced_over_serial']:.2f}; footprints "
              f"{row['footprints_total_bytes'] / GIB:.1f} of {shapes.capacity_bytes / GIB:.1f} GiB; parks "
              f"{sum(row['parks'].values())}, moved {row['bytes_moved'] / GIB:.0f} GiB; parks by worker {row['parks']}",
              flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        kept = {k: v for k, v in vars(args).items() if k not in ("configs", "out")}
        args.out.write_text(json.dumps({"bench": "schedule_sim", "model": "a simulation (see the module docs)",
                                        "jobs": [vars(j) for j in shapes.jobs], "args": kept, "rows": rows},
                                       indent=2) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
