"""Issue 32, item 3: the seed's three-job experiment with fixed groups and with one elastic group.

Runs ``rota demo``'s workload (3 jobs x (trainer + sampler)) at one trainer-state size, side by side:

* dedicated (and serial, from the same runs): each job alone on its own 2 GPUs;
* fixed groups: trainers share one group (cuda:0), samplers another (cuda:1), as the seed ran it;
* elastic: one group over every GPU (``ROTA_DEVICES`` of all of them); rota places each turn.

and, with two GPUs, a move benchmark: a tracked model moved cuda:0 -> cuda:1 by rota_torch (peer
copy) against the peer-copy floor (one buffer of the same size, cuda:0 -> cuda:1) and against going
through host memory (park, then restore on cuda:1).

Writes one JSON (``--out``): per mode makespan, GPU-hours, ratios to serial and dedicated, busy per
GPU (each group's, or each lane ``gpus@cuda:N`` of the elastic group), switches, moves, parks,
restores, every worker's timeline (turn/wait/park/restore/move events), whether every curve is
bit-identical to the dedicated runs, and the issue's targets met or not. Timeline PNGs go beside it.

``--smoke`` proves the script end to end on one GPU (tiny models, few steps): both "groups" and the
elastic group's one lane are on cuda:0, so nothing about speed is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import sys
import time
from typing import Any

TARGETS = {  # issue 32, item 3: time-sliced makespan over serial, and GPU-hours over dedicated
    "60GB": {"elastic_over_serial": 0.50, "fixed_over_serial": 0.65, "gpu_hours_over_dedicated": 0.35},
    "20GB": {"elastic_over_serial": 0.35, "gpu_hours_over_dedicated": 0.35},
}


def move_bench(gb: float) -> dict[str, Any]:
    """rota_torch's move cuda:0 -> cuda:1 of a ``gb`` GB model, the peer-copy floor, and the host path."""
    import torch
    from torch import nn

    import rota
    import rota_fsdp
    from rota import ParkPlan
    from rota.testing import running_orchestrator

    layers = max(1, int(gb * 1e9 // (4096 * 4096 * 4)))
    nbytes = layers * 4096 * 4096 * 4
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")
    floors = []
    for _ in range(3):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        floors.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    out: dict[str, Any] = {"bytes": nbytes, "peer_access": torch.cuda.can_device_access_peer(0, 1),
                           "floor_s": min(floors)}
    with running_orchestrator() as (endpoint, _):
        gpu = rota.connect(group="move", tenant="m", endpoint=endpoint)
        model = nn.Sequential(*[nn.Linear(4096, 4096, bias=False) for _ in range(layers)]).to("cuda:0")
        tracked = rota_fsdp.track(gpu, model, None, tags=("weights",))
        tracked.prepare()
        moves, host = [], []
        for a, b in (("cuda:1", "cuda:0"), ("cuda:1", "cuda:0")):
            moves.append(tracked.restore(ParkPlan(device=a)).seconds)
            moves.append(tracked.restore(ParkPlan(device=b)).seconds)
        for target in ("cuda:1", "cuda:0"):
            t0 = time.perf_counter()
            tracked.park()
            tracked.restore(ParkPlan(device=target))
            host.append(time.perf_counter() - t0)
        tracked.untrack()
        gpu.close()
    out.update(move_s=min(moves), move_s_all=moves, host_path_s=min(host),
               move_gbps=nbytes / min(moves) / 1e9, floor_gbps=nbytes / out["floor_s"] / 1e9,
               move_over_floor=min(moves) / out["floor_s"], host_over_move=min(host) / min(moves))
    return out


def _events(results: dict[str, Any]) -> dict[str, dict[str, list]]:
    """Every worker's timeline of every mode: (kind, start s, end s), kinds turn/after/wait/park/restore/move/off."""
    return {mode: {name: [(k, round(a, 4), round(b, 4)) for k, a, b in r.events]
                   for name, r in sorted(res.reports.items())} for mode, res in results.items()}


def run(state: str, steps: int, capacity: int, host_memory: int, resident_first: float, out: pathlib.Path,
        smoke: bool) -> dict[str, Any]:
    import torch

    from rota.config import parse_bytes
    from rota_demo.memory import host_memory_plan
    from rota_demo.report import summarize, timeline_png
    from rota_demo.runner import DemoConfig, run_demo
    from rota_demo.workloads import ModelSize

    def progress(line: str) -> None:
        print(f"{time.monotonic() - t0:7.1f}s  {line}", file=sys.stderr, flush=True)

    t0 = time.monotonic()
    size = ModelSize(hidden=256, layers=2, batch=64, seq=16) if smoke else \
        ModelSize.for_state_bytes(parse_bytes(state, what="--state"), batch=64, seq=16)
    base = DemoConfig(steps=steps, groups=2, device="cuda", size=size, capacity_bytes=capacity,
                      host_memory_bytes=host_memory, resident_first_s=resident_first if capacity else 0.0)
    report: dict[str, Any] = {"bench": "elastic_x2", "commit": os.environ.get("ROTA_COMMIT", "unknown"),
                              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                              "state": state, "smoke": smoke, "steps": steps,
                              "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
                              "torch": torch.__version__, "capacity_bytes": capacity,
                              "resident_first_s": base.resident_first_s,
                              "trainer_state_bytes": size.trainer_state_bytes}
    print(host_memory_plan(base).describe(), file=sys.stderr)

    def save() -> None:
        out.write_text(json.dumps(report, indent=1, default=str) + "\n")

    if torch.cuda.device_count() >= 2:
        report["move"] = move_bench(0.5 if smoke else 8.0)
        progress(f"move: {report['move']}")
        save()
    fixed = run_demo(dataclasses.replace(base, modes=("dedicated", "serial", "timesliced")), progress)
    fixed_sum = summarize(base, fixed)
    timeline_png(fixed, out.with_name(out.stem + "-fixed-timeline.png"))
    report["fixed"] = {k: v for k, v in fixed_sum.items() if k != "curves"}
    report["timelines"] = {"fixed": _events(fixed)}
    save()
    elastic_cfg = dataclasses.replace(base, modes=("timesliced",), elastic=True)
    elastic = run_demo(elastic_cfg, progress)
    elastic_sum = summarize(elastic_cfg, {**elastic, "dedicated": fixed["dedicated"], "serial": fixed["serial"]})
    timeline_png(elastic, out.with_name(out.stem + "-elastic-timeline.png"))
    report["elastic"] = {k: v for k, v in elastic_sum.items() if k != "curves"}
    report["timelines"]["elastic"] = _events(elastic)
    ded, ser = fixed["dedicated"], fixed["serial"]

    def ratios(ts: Any) -> dict[str, float]:
        return {"over_serial": ts.makespan_s / ser.makespan_s,
                "gpu_hours_over_dedicated": ts.devices * ts.makespan_s / (ded.devices * ded.makespan_s)}

    def identical(ts: Any) -> bool:
        return all(ts.reports[n].values == ded.reports[n].values and ded.reports[n].values for n in ded.reports)

    report["summary"] = {
        "fixed": {**ratios(fixed["timesliced"]), "bit_identical": identical(fixed["timesliced"]),
                  "busy_by_group": report["fixed"]["timesliced"]["busy_by_group"]},
        "elastic": {**ratios(elastic["timesliced"]), "bit_identical": identical(elastic["timesliced"]),
                    "busy_by_gpu": report["elastic"]["timesliced"]["busy_by_group"],
                    "moves": report["elastic"]["timesliced"]["moves"]},
    }
    targets = {} if smoke else TARGETS.get(state, {})
    s = report["summary"]
    checks = {"elastic_over_serial": s["elastic"]["over_serial"], "fixed_over_serial": s["fixed"]["over_serial"],
              "gpu_hours_over_dedicated": s["elastic"]["gpu_hours_over_dedicated"]}
    report["targets"] = {k: {"target": t, "measured": checks[k], "met": checks[k] <= t} for k, t in targets.items()}
    save()
    progress(f"summary: {json.dumps(report['summary'])}")
    progress(f"targets: {json.dumps(report['targets'])}")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--state", default="20GB", help="trainer state per job (20GB, 60GB)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--capacity", default="130GB", help="device bytes per group/lane for residency")
    ap.add_argument("--host-memory", default="", help="host memory the demo may use (default: MemAvailable)")
    ap.add_argument("--resident-first", type=float, default=0.0, help="seconds (0 = off); 60GB ran with 120")
    ap.add_argument("--smoke", action="store_true", help="one GPU, tiny models: the script end to end")
    ap.add_argument("--out", type=pathlib.Path, required=True)
    a = ap.parse_args()
    from rota.config import parse_bytes

    a.out.parent.mkdir(parents=True, exist_ok=True)
    run(a.state, a.steps, parse_bytes(a.capacity, what="--capacity"),
        parse_bytes(a.host_memory, what="--host-memory") if a.host_memory else 0, a.resident_first, a.out, a.smoke)


if __name__ == "__main__":
    main()
