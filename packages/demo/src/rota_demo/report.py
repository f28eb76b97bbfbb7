"""The demo's outputs: the comparison table, ``demo.json`` and the timeline PNG."""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

import numpy as np

from rota.config import format_bytes
from rota_demo.memory import push_plan
from rota_demo.runner import JOBS, DemoConfig, ModeResult

__all__ = ["failures_line", "footprints_line", "summarize", "table", "timeline_lanes", "timeline_png", "write_json"]

FAILURES_KEPT = 50  # failed parks/restores listed in demo.json (all are counted)
FAILURE_CHARS = 600


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of ``values``, as rota status reports them; 0.0 when empty."""
    return float(np.percentile(values, q, method="nearest")) if values else 0.0


_COLOURS = {"turn": "#2ca02c", "after": "#9467bd", "wait": "#d9d9d9", "park": "#d62728", "restore": "#1f77b4",
            "move": "#17becf", "off": "#ff7f0e"}
_LABELS = {"turn": "on device (turn)", "after": "weight push after the turn (copy engine)",
           "wait": "waiting for a turn", "park": "park", "restore": "restore", "move": "move to another GPU",
           "off": "off device (reward / data)"}


def _device_time(res: ModeResult, role: str = "") -> float:
    """Seconds of device turns, of every worker or of one role's (``trainer``/``sampler``)."""
    return sum(b - a for name, r in res.reports.items() if name.endswith("/" + role) or not role
               for k, a, b in r.events if k == "turn")


def _role_busy(res: ModeResult, role: str) -> float:
    """Busy fraction of the device(s) a role runs on: its turns over the makespan, per device it has."""
    devices = len(JOBS) if res.mode == "dedicated" else 1
    return _device_time(res, role) / (devices * res.makespan_s) if res.makespan_s else 0.0


def _floor_makespan(cfg: DemoConfig, ser: ModeResult, ded: ModeResult | None, devices: int) -> float:
    """The shortest makespan any time-sliced schedule of the serial run's work could have on ``devices``: its
    busiest device's turns (trainers' and samplers' devices apart with ``--groups 2``), and no shorter than the
    longest job alone. Switches cost on top; only the jobs' time off the device can overlap."""
    if cfg.groups == 2 and not cfg.elastic:
        work = max(_device_time(ser, "trainer"), _device_time(ser, "sampler"))
    else:
        work = _device_time(ser) / max(devices, 1)
    return max(work, ded.makespan_s if ded is not None else 0.0)


def _pretraining(size: Any) -> dict[str, Any] | None:
    """How an LLM job's starting checkpoint was pre-trained (its ``rota-demo.json``): optimizer steps taken, and
    a rollout's expected reward measured on fresh questions before the first and the last measurement (where it
    stopped, when it reached ``pretrain_reward``); None for toy jobs or a checkpoint without the record."""
    from rota_demo.llm_models import checkpoint_record  # torch: only where an LLM job is reported

    built = checkpoint_record(getattr(size, "ckpt", ""))
    if built is None:
        return None
    rewards = built.get("pretrain_expected_rewards") or [None]
    return {"steps": len(built.get("pretrain_losses") or []), "expected_reward_first": rewards[0],
            "expected_reward_last": rewards[-1]}


def _job_end(res: ModeResult, job: str) -> float:
    ends = [r.end - r.start for name, r in res.reports.items() if name.startswith(job + "/")]
    return max(ends) if ends else 0.0


def summarize(cfg: DemoConfig, results: dict[str, ModeResult]) -> dict[str, Any]:
    """The numbers of demo.json."""
    out: dict[str, Any] = {"device": cfg.device, "config": {
        "steps": cfg.steps, "groups": cfg.groups, "elastic": cfg.elastic, "off_device_s": cfg.off_device_s,
        "seed": cfg.seed, "policy": cfg.policy, "resident_first_s": cfg.resident_first_s, "sft_turns": cfg.sft_turns,
        "engine": cfg.engine, "models": {job: {**cfg.job_size(job).__dict__, "params": getattr(
            cfg.job_size(job), "params", None), "trainer_state_bytes": cfg.job_size(job).trainer_state_bytes,
                                          "push_buffer_bytes": push_plan(cfg.engine, cfg.job_size(job))[0],
                                          "pretraining": _pretraining(cfg.job_size(job))}
                                    for job, _ in JOBS},
        "model": cfg.size.__dict__ if not cfg.llm_sizes else None,
        "trainer_state_bytes": cfg.job_size("sft").trainer_state_bytes if cfg.llm_sizes
        else cfg.size.trainer_state_bytes, "push_buffer_bytes": cfg.size.push_bytes if not cfg.llm_sizes else None}}
    for mode, res in results.items():
        out[mode] = {"makespan_s": res.makespan_s, "devices": res.devices,
                     "device_seconds": res.devices * res.makespan_s,
                     "gpu_hours": res.devices * res.makespan_s / 3600,
                     "busy_fraction": _device_time(res) / (res.devices * res.makespan_s) if res.makespan_s else 0.0,
                     "how": res.how,
                     # wall time outside the measured run: spawning, imports, building, pinning; exits
                     "setup_s": sum(x.setup_s for x in res.setups), "teardown_s": sum(x.teardown_s for x in res.setups),
                     "setups": [dataclasses.asdict(x) for x in res.setups]}
        if cfg.groups == 2 and not (cfg.elastic and mode == "timesliced"):  # trainers' device, samplers' device
            out[mode]["trainer_device_busy"] = _role_busy(res, "trainer")
            out[mode]["sampler_device_busy"] = _role_busy(res, "sampler")
    ded, ser, ts = results.get("dedicated"), results.get("serial"), results.get("timesliced")
    ref = ded or ser  # the runs of each job alone
    if ts is not None:
        parks = [p for r in ts.reports.values() for p in r.parks]
        restores = [p for r in ts.reports.values() for p in r.restores]
        waits = [w for r in ts.reports.values() for w in r.waits_ms]
        moves = [m for r in ts.reports.values() for m in r.moves]
        out["timesliced"].update({
            "orchestrator_busy_fraction": ts.busy_seconds / (ts.devices * ts.makespan_s) if ts.makespan_s else 0.0,
            "switches": ts.switches, "parks": len(parks),
            "parks_by_worker": {name: len(r.parks) for name, r in sorted(ts.reports.items())},
            "restores": len(restores), "prefetch": ts.prefetch,
            "park_ms_p50": percentile([s * 1000 for _, s in parks], 50),
            "park_ms_p99": percentile([s * 1000 for _, s in parks], 99),
            "restore_ms_p50": percentile([s * 1000 for _, s in restores], 50),
            "restore_ms_p99": percentile([s * 1000 for _, s in restores], 99),
            "bytes_moved": sum(b for b, _ in parks) + sum(b for b, _ in restores),
            "wait_ms_p50": percentile(waits, 50), "wait_ms_p99": percentile(waits, 99),
            "adapters": sorted({r.adapter for r in ts.reports.values()}),
            "pool_setup_s_max": max((r.pool_setup_s for r in ts.reports.values()), default=0.0),
            "capacity_bytes": cfg.capacity_bytes, "capacity_how": cfg.capacity_how, "policy": cfg.policy,
            "resident_first_s": cfg.resident_first_s,
            "push_pinned": all(r.push_pinned for r in ts.reports.values()),
            # held seconds over the makespan of each group, or of each device of the --elastic group (gpus@cuda:N)
            "busy_by_group": {g: b / ts.makespan_s for g, b in sorted(ts.busy_by_group.items())} if ts.makespan_s
            else {},
            "failed_parks": sum(1 for r in ts.reports.values() for k, _ in r.failures if k == "park"),
            "failed_restores": sum(1 for r in ts.reports.values() for k, _ in r.failures if k == "restore"),
            "failures": [{"worker": name, "kind": k, "error": why[:FAILURE_CHARS]}
                         for name, r in sorted(ts.reports.items()) for k, why in r.failures][:FAILURES_KEPT],
            "footprints": {g: {name: {t: b for t, b in r.footprint.items() if b}
                               for name, r in sorted(ts.reports.items()) if r.group == g and r.footprint}
                           for g in sorted({r.group for r in ts.reports.values() if r.footprint})},
            "moves": len(moves), "move_ms_p50": percentile([s * 1000 for _, s in moves], 50),
            "move_ms_p99": percentile([s * 1000 for _, s in moves], 99), "bytes_moved_device_to_device":
            sum(b for b, _ in moves),
        })
    ratios: dict[str, float] = {}
    if ts and ser:
        ratios["timesliced_over_serial_makespan"] = ts.makespan_s / ser.makespan_s
        ratios["timesliced_floor_over_serial_makespan"] = _floor_makespan(cfg, ser, ded, ts.devices) / ser.makespan_s
    if ts and ded:
        ratios["timesliced_over_dedicated_device_seconds"] = (ts.devices * ts.makespan_s) / (
            ded.devices * ded.makespan_s)
    if ser and ded:
        ratios["serial_over_dedicated_device_seconds"] = (ser.devices * ser.makespan_s) / (ded.devices * ded.makespan_s)
    out["ratios"] = ratios
    tenants = []
    for job, kind in JOBS:
        row: dict[str, Any] = {"name": job, "kind": kind}
        if ref:
            row["dedicated_s"] = ref.job_spans.get(job, 0.0)
        if ser:
            row["serial_s"] = ser.job_spans.get(job, 0.0)
        if ts:
            row["timesliced_s"] = _job_end(ts, job)
        if ts and ref:
            row["slowdown"] = row["timesliced_s"] / row["dedicated_s"] if row["dedicated_s"] else 0.0
            pairs = [(ref.reports[n].values, ts.reports[n].values) for n in ref.reports if n.startswith(job + "/")]
            row["bit_identical"] = all(a == b and len(a) > 0 for a, b in pairs)
            row["final_loss"] = ts.reports[f"{job}/trainer"].values[-1]
        if ref or ts:  # the engine's (sampler's) curve: RL mean reward per step, SFT eval (loss or accuracy)
            curve = (ref or ts).reports[f"{job}/sampler"].values
            row["sampler_first"], row["sampler_last"] = (curve[0], curve[-1]) if curve else (None, None)
        tenants.append(row)
    out["tenants"] = tenants
    # every worker's curve (trainer losses; sampler rewards or eval losses), so runs can be compared later
    out["curves"] = {mode: {name: r.values for name, r in sorted(res.reports.items())}
                     for mode, res in results.items()}
    out["curve_meaning"] = curve_meaning(cfg)
    return out


def curve_meaning(cfg: DemoConfig) -> dict[str, str]:
    """What each worker's curve holds (per step for trainers and RL samplers, per push for the SFT sampler)."""
    if cfg.llm_sizes:
        return {"trainer": "loss per step (GRPO for RL, cross-entropy for SFT)",
                "rl sampler": f"mean reward per step ({cfg.engine} engine, exact answers)",
                "sft sampler": f"eval exact-match accuracy per push ({cfg.engine} engine, greedy)"}
    return {"trainer": "loss per step", "rl sampler": "mean reward per step", "sft sampler": "eval loss per push"}


def failures_line(summary: dict[str, Any]) -> str:
    """"" when every park and restore succeeded; else what failed, for the summary and the exit message."""
    ts = summary.get("timesliced") or {}
    parks, restores = ts.get("failed_parks", 0), ts.get("failed_restores", 0)
    if not parks and not restores:
        return ""
    first = ts["failures"][0]
    return (f"{parks} failed park(s) and {restores} failed restore(s) in the time-sliced run; the first: "
            f"{first['kind']} of {first['worker']}: {first['error']}")


def footprints_line(footprints: dict[str, dict[str, dict[str, int]]], capacity: int) -> str:
    """What fits, per group: each worker's largest footprint at a turn's end (by tag where it has several), their
    sum, and whether the group's capacity holds them all at once (if not, the policy must park)."""
    def one(name: str, tags: dict[str, int]) -> str:
        parts = f" ({', '.join(f'{t} {format_bytes(b)}' for t, b in sorted(tags.items()))})" if len(tags) > 1 else ""
        return f"{name} {format_bytes(sum(tags.values()))}{parts}"

    out = []
    for group, workers in footprints.items():
        total = sum(sum(tags.values()) for tags in workers.values())
        line = f"{group}: " + ", ".join(one(n, tags) for n, tags in workers.items())
        line += f"; together {format_bytes(total)}"
        if capacity:
            line += f" against {format_bytes(capacity)}: " + (
                "all fit at once" if total <= capacity else "they do not all fit at once, so the policy parks")
        out.append(line)
    return "footprints (largest at a turn's end, as rota counts them) per group: " + "; ".join(out)


def table(summary: dict[str, Any]) -> str:
    """The terminal table."""
    lines: list[str] = []
    r = summary["ratios"]
    if "timesliced_over_serial_makespan" in r:
        ratio = r["timesliced_over_serial_makespan"]
        change = f"{1 - ratio:.0%} shorter" if ratio <= 1 else f"{ratio - 1:.0%} longer"
        lines.append(f"time-sliced makespan / serial makespan = {ratio:.2f} ({change})")
        if "timesliced_floor_over_serial_makespan" in r:
            lines.append(f"  no time-sliced schedule of this work does better than "
                         f"{r['timesliced_floor_over_serial_makespan']:.2f}: the serial run's busiest device's "
                         "turns (or the longest job alone); only time off the device can overlap")
    if lines:
        lines.append("")
    lines.append(f"{'mode':<12} {'GPUs':>5} {'makespan':>9} {'GPU-hours':>10} {'vs dedicated':>13} "
                 f"{'trainer GPU busy':>17} {'sampler GPU busy':>17}")
    base_h = summary.get("dedicated", {}).get("gpu_hours")
    for mode in ("dedicated", "serial", "timesliced"):
        m = summary.get(mode)
        if not m:
            continue
        rel = f"{m['gpu_hours'] / base_h:.2f}x" if base_h else "-"
        tb = f"{m['trainer_device_busy']:.0%}" if "trainer_device_busy" in m else "-"
        sb = f"{m['sampler_device_busy']:.0%}" if "sampler_device_busy" in m else "-"
        if "trainer_device_busy" not in m:
            tb = f"{m['busy_fraction']:.0%} (all)"
        lines.append(f"{mode:<12} {m['devices']:>5} {m['makespan_s']:>8.1f}s {m['gpu_hours']:>10.4f} {rel:>13} "
                     f"{tb:>17} {sb:>17}")
    for mode in ("dedicated", "serial", "timesliced"):
        if summary.get(mode, {}).get("how"):
            lines.append(f"  {mode}: {summary[mode]['how']}")
    outside = [(mode, summary[mode]) for mode in ("serial" if "serial" in summary else "dedicated", "timesliced")
               if summary.get(mode, {}).get("setups")]
    if outside:  # the runs alone serve both dedicated and serial: counted once
        lines.append("outside the measured runs (spawning, imports, building, pinning; exits): " + ", ".join(
            f"{'runs alone' if mode != 'timesliced' else mode} {m['setup_s']:.1f} s + {m['teardown_s']:.1f} s"
            for mode, m in outside))
    ts = summary.get("timesliced")
    if ts:
        lines.append(f"switches {ts['switches']}, parks {ts['parks']} (p50 {ts['park_ms_p50']:.1f} ms, p99 "
                     f"{ts['park_ms_p99']:.1f} ms), restores {ts['restores']} (p50 {ts['restore_ms_p50']:.1f} ms, "
                     f"p99 {ts['restore_ms_p99']:.1f} ms), moved {format_bytes(ts['bytes_moved'])}, "
                     f"queue wait p50 {ts['wait_ms_p50']:.1f} ms p99 {ts['wait_ms_p99']:.1f} ms, "
                     f"adapters: {', '.join(ts['adapters'])}")
        if ts.get("busy_by_group"):
            lines.append("busy per group (device): " + ", ".join(f"{g} {b:.0%}" for g, b in ts["busy_by_group"].items())
                         + f"; moves device to device {ts['moves']} (p50 {ts['move_ms_p50']:.1f} ms)")
        lines.append(f"failed parks {ts.get('failed_parks', 0)}, failed restores {ts.get('failed_restores', 0)}"
                     + (f"; capacity {format_bytes(ts['capacity_bytes'])} per group ({ts.get('capacity_how') or 'set'})"
                        if ts.get("capacity_bytes") else "; capacity 0: every switch parks"))
        if any((ts.get("footprints") or {}).values()):  # --elastic: one group over every device, each its capacity
            per_group = ts.get("capacity_bytes", 0) * (ts["devices"] if summary["config"]["elastic"] else 1)
            lines.append(footprints_line(ts["footprints"], per_group))
        pre = ts.get("prefetch") or {}
        if any(pre.values()):
            lines.append(f"prefetch (next tenant restored during the holder's turn): {pre.get('hits', 0)} hits, "
                         f"{pre.get('misses', 0)} misses, {pre.get('failures', 0)} failures, "
                         f"{pre.get('wasted', 0)} wasted")
    lines.append("")
    lines.append(f"{'tenant':<8} {'dedicated':>10} {'serial':>8} {'sliced':>8} {'slowdown':>9} {'bit-identical':>14}")
    for t in summary["tenants"]:
        def cell(key: str, t: dict[str, Any] = t) -> str:
            return f"{t[key]:.1f}s" if key in t else "-"

        slow = f"{t['slowdown']:.2f}x" if "slowdown" in t else "-"
        ident = str(t.get("bit_identical", "-"))
        lines.append(f"{t['name']:<8} {cell('dedicated_s'):>10} {cell('serial_s'):>8} {cell('timesliced_s'):>8} "
                     f"{slow:>9} {ident:>14}")
    return "\n".join(lines)


def write_json(summary: dict[str, Any], path: pathlib.Path) -> None:
    path.write_text(json.dumps(summary, indent=2) + "\n")


def timeline_lanes(res: ModeResult) -> list[tuple[str, str, str]]:
    """(worker, lane label, group) per lane, in lane order: workers that share a device (a rota group) are
    adjacent and labelled with it; workers with a device of their own are labelled "own device"."""
    names = sorted(res.reports, key=lambda n: (res.reports[n].group == "", res.reports[n].group, n))
    return [(n, f"{n} [{res.reports[n].group or 'own device'}]", res.reports[n].group) for n in names]


def timeline_png(results: dict[str, ModeResult], path: pathlib.Path, meaning: dict[str, str] | None = None) -> None:
    """One panel per mode, one lane per worker: turns, waits, parks, restores, off-device; the lanes of one
    shared device (group) are banded together and named by it. Below: each job's trainer loss and sampler
    (engine) curve, one line per mode (equal curves overlap)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    modes = [m for m in ("serial", "timesliced", "dedicated") if m in results]
    xmax = max(res.makespan_s for res in results.values())
    fig = plt.figure(figsize=(12, 2.2 + 1.6 * len(modes) + 4.0))
    top, bottom = fig.subfigures(2, 1, height_ratios=[2.2 + 1.6 * len(modes), 4.0])
    axes = top.subplots(len(modes), 1, squeeze=False, sharex=True)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        res = results[mode]
        lanes = timeline_lanes(res)
        for lane, (name, _, _) in enumerate(lanes):
            for kind, a, b in res.reports[name].events:
                if kind in _COLOURS and b > a:
                    ax.broken_barh([(a, b - a)], (lane - 0.4, 0.8), facecolors=_COLOURS[kind], linewidth=0)
        groups = [g for _, _, g in lanes]
        for band, group in enumerate(dict.fromkeys(g for g in groups if g)):  # one shaded band per shared device
            rows = [i for i, g in enumerate(groups) if g == group]
            ax.axhspan(rows[0] - 0.5, rows[-1] + 0.5, color="#000000", alpha=0.04 + 0.04 * (band % 2), zorder=0)
            ax.axhline(rows[-1] + 0.5, color="#777777", linewidth=0.6)
        ax.set_yticks(range(len(lanes)), [label for _, label, _ in lanes], fontsize=8)
        ax.set_xlim(0, xmax * 1.02)
        ax.set_title(f"{mode}: makespan {res.makespan_s:.1f} s on {res.devices} device(s)", fontsize=10, loc="left")
    axes[-1, 0].set_xlabel("seconds since start")
    top.legend(handles=[Patch(color=c, label=_LABELS[k]) for k, c in _COLOURS.items()], loc="upper center",
               ncol=7, fontsize=8, frameon=False)
    _curves(bottom, results, meaning or {})
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _curves(fig, results: dict[str, ModeResult], meaning: dict[str, str]) -> None:
    """Two rows (trainer loss, sampler reward or eval) by one column per job; a line per mode."""
    axes = fig.subplots(2, len(JOBS), squeeze=False)
    fig.subplots_adjust(hspace=0.45)
    styles = {"dedicated": ("#1f77b4", "-", 3.0), "serial": ("#2ca02c", "--", 2.0), "timesliced": ("#d62728", ":",
                                                                                                      1.6)}
    for col, (job, kind) in enumerate(JOBS):
        for row, role in enumerate(("trainer", "sampler")):
            ax = axes[row, col]
            for mode, res in results.items():
                values = res.reports.get(f"{job}/{role}")
                if values is not None and values.values:
                    colour, line, width = styles.get(mode, ("#000000", "-", 1.0))
                    ax.plot(range(1, len(values.values) + 1), values.values, line, color=colour, linewidth=width,
                            label=mode)
            what = meaning.get("trainer" if role == "trainer" else f"{kind} sampler", role)
            ax.set_title(f"{job} {role}: {what.split(' per ')[0]}", fontsize=8, loc="left")  # demo.json has more
            ax.tick_params(labelsize=7)
    axes[0, 0].legend(fontsize=7, frameon=False)
