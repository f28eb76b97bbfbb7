"""``rota demo``: run the three-tenant comparison and print the table."""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

import click

from rota.cli.options import resident_first_option
from rota.config import parse_bytes
from rota.errors import RotaError

__all__ = ["demo", "engine_shares"]


@click.command()
@click.option("--steps", type=click.IntRange(min=1), default=16, show_default=True, help="Training steps per job.")
@click.option("--groups", type=click.IntRange(1, 2), default=2, show_default=True,
              help="2: trainers share one device and samplers another; 1: every worker on one device.")
@click.option("--device", default="cpu", show_default=True, help="cpu, cuda or cuda:N.")
@click.option("--elastic", is_flag=True,
              help="Time-sliced on one group over every GPU of the host (ROTA_DEVICES of all of them): rota places "
              "each turn on a GPU and moves resident state device to device. Needs --device cuda.")
@click.option("--hidden", type=click.IntRange(min=8), default=512, show_default=True, help="Model width.")
@click.option("--layers", type=click.IntRange(min=1), default=3, show_default=True, help="Residual blocks.")
@click.option("--state", "state_size", default="",
              help="Size the models so each trainer holds about this much state (e.g. 20GB); overrides "
              "--hidden/--layers. For --device cuda runs that park tens of GB.")
@click.option("--batch", type=click.IntRange(min=1), default=64, show_default=True,
              help="Sequences per step (more = more device work per turn).")
@click.option("--seq", type=click.IntRange(min=2), default=16, show_default=True, help="Tokens per sequence.")
@click.option("--capacity", default="auto", show_default=True,
              help="Device memory per group for residency (e.g. 120GiB): tenants that fit stay resident and a "
              "switch parks only when memory requires it. auto: on CUDA, what the device holds less a margin of "
              "10% (at least 8 GiB), split between groups that share one device; on CPU, 0. 0 = park at every "
              "switch.")
@click.option("--off-device", type=click.FloatRange(min=0), default=0.1, show_default=True,
              help="Seconds of host work per step (reward judge for RL, data loading for SFT).")
@click.option("--modes", default="dedicated,serial,timesliced", show_default=True,
              help="Which runs to make, comma-separated. Dedicated and serial share their runs: each job alone "
              "on its own devices.")
@click.option("--policy", type=click.Choice(["priority", "fifo"]), default="priority", show_default=True,
              help="Time-sliced turn order: priority runs the RL jobs' turns first (each RL step waits for its "
              "own sampler and trainer in turn) and lets SFT fill the gaps; fifo is first come, first served.")
@resident_first_option()
@click.option("--sft-turns", type=click.IntRange(min=1), default=4, show_default=True,
              help="The SFT trainer splits each step into this many microbatches (gradient accumulation), one "
              "turn each, so an RL turn waits one microbatch at most. Every mode runs the same split, so the "
              "losses compare bit for bit; it must divide --batch.")
@click.option("--seed", type=int, default=0, show_default=True,
              help="Seed of the models, data and samples; job i uses SEED+i in every mode, so the runs it compares "
              "start from the same weights and see the same batches.")
@click.option("--host-memory", default="",
              help="Host memory the run may use (e.g. 120GB); the demo refuses to start if its estimate is larger. "
              "Default: MemAvailable, or the memory cgroup's room if smaller. Set it where MemAvailable "
              "under-reads, e.g. a VM whose memory grows as it is used.")
@click.option("--engine", type=click.Choice(["toy", "hf", "vllm"]), default="toy", show_default=True,
              help="toy: rota's own small models and sampler. hf or vllm: LLM jobs that learn (GRPO on generated "
              "string tasks with exact-answer rewards; SFT on generated text, evaluated by its engine), Qwen3-"
              "architecture checkpoints built and pre-trained briefly in the run. vllm: vllm.LLM in-process, "
              "sleep mode, tracked by rota_vllm (needs a GPU and vLLM). hf: NOT an inference engine but a stand-in "
              "for one: the trainer's transformers model running generate(), parked by rota_fsdp; it runs on CPU.")
@click.option("--llm-size", type=click.Choice(["tiny", "h100", "h200"]), default="tiny", show_default=True,
              help="With --engine hf|vllm, the jobs' model shapes (rl-a, rl-b, sft): tiny, about 76k parameters "
              "each (CPU, CI); h200, Qwen3-0.6B/1.7B/4B shapes (about 0.44B, 1.4B, 3.6B) for one H200 (the 4B "
              "job alone needs about 89 GiB of device memory: a smaller card is refused before anything is built); "
              "h100, the same for one 80 GB card (0.44B, 1.4B and a 20-layer 4B shape, 2.0B; the largest alone "
              "needs about 43 GiB).")
@click.option("--engine-memory", default="",
              help="With --engine vllm: each job's engine share of the device (vLLM's gpu_memory_utilization: "
              "weights and KV cache), one fraction for all three jobs or three for rl-a,rl-b,sft, e.g. "
              "0.2,0.25,0.3. Larger shares leave less room beside the engines, so more trainers park. Default: "
              "the --llm-size preset's (h200: 0.10,0.12,0.20; h100: 0.10,0.12,0.12; tiny: 0.1 each).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=pathlib.Path), default=None,
              help="With --engine hf|vllm: where built starting checkpoints are kept, named by a hash of their "
              "config, so a repeated run loads them instead of building. Default: ~/.cache/rota-demo.")
@click.option("--out-dir", type=click.Path(file_okay=False, path_type=pathlib.Path), default=".",
              show_default=True, help="Where demo.json and demo-timeline.png go.")
def demo(steps: int, groups: int, device: str, elastic: bool, hidden: int, layers: int, state_size: str, batch: int,
         seq: int, capacity: str, off_device: float, modes: str, policy: str, resident_first: float, sft_turns: int,
         seed: int, host_memory: str, engine: str, llm_size: str, engine_memory: str, cache_dir: pathlib.Path | None,
         out_dir: pathlib.Path) -> None:
    """Three real training jobs take turns on shared devices; compare with dedicated and serial.

    Two RL jobs (a sampler generates with the current policy, a judge scores off the
    device, the trainer does a policy-gradient step and pushes weights back) and one
    SFT job (trainer + eval sampler), each a trainer and a sampler process.

    \b
    dedicated    each job alone on its own devices (trainer's and sampler's); makespan =
                 the longest job, GPU-hours = 2 devices per job x that
    serial       the same runs end to end on the shared devices
    time-sliced  all jobs at once on the shared devices, taking turns through rota

    Prints makespan, GPU-hours, each device's busy fraction, per-tenant slowdown,
    switches, park/restore and wait percentiles, and whether every loss curve is
    bit-identical to its dedicated run. Writes demo.json and demo-timeline.png.
    """
    try:
        from rota_demo.memory import DeviceMemoryShort, HostMemoryShort, host_memory_plan
        from rota_demo.report import failures_line, summarize, table, timeline_png, write_json
        from rota_demo.runner import DemoConfig, WorkerFailed, prepare_demo, run_modes
        from rota_demo.workloads import ModelSize
    except ImportError as exc:
        raise click.ClickException(f"rota demo needs torch and matplotlib ({exc}): "
                                   "pip install rota-demo") from None
    try:
        size = ModelSize.for_state_bytes(parse_bytes(state_size, what="--state"), batch=batch, seq=seq) \
            if state_size else ModelSize(hidden=hidden, layers=layers, batch=batch, seq=seq)
        capacity_bytes = parse_bytes(capacity, what="--capacity") if capacity.strip().lower() != "auto" else -1
        host_memory_bytes = parse_bytes(host_memory, what="--host-memory") if host_memory else 0
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    shares = engine_shares(engine_memory)
    if shares and engine != "vllm":
        raise click.UsageError(f"--engine-memory is vLLM's gpu_memory_utilization per job; --engine {engine} has no "
                               "such share: use it with --engine vllm, or leave it out")
    if capacity_bytes < 0 and capacity.strip().lower() != "auto":
        raise click.UsageError(f"--capacity {capacity!r} must be >= 0 bytes, or auto")
    if host_memory and host_memory_bytes <= 0:
        raise click.UsageError(f"--host-memory {host_memory!r} must be > 0 (omit it to read MemAvailable)")
    cfg = DemoConfig(steps=steps, groups=groups, device=device, size=size, off_device_s=off_device, seed=seed,
                     modes=tuple(m.strip() for m in modes.split(",") if m.strip()),
                     capacity_bytes=max(capacity_bytes, 0),
                     host_memory_bytes=host_memory_bytes, policy=policy, resident_first_s=resident_first,
                     sft_turns=sft_turns, elastic=elastic, engine=engine,
                     cache_dir=str(cache_dir or pathlib.Path.home() / ".cache" / "rota-demo"))
    if engine != "toy":
        try:
            from rota_demo.llm_models import PRESETS
        except ImportError as exc:
            raise click.ClickException(f"rota demo --engine {engine} needs transformers and tokenizers ({exc}): "
                                       "pip install \"rota-demo[llm]\"") from None
        sizes = PRESETS[llm_size]
        if shares:
            sizes = tuple(dataclasses.replace(size, engine_memory=f) for size, f in zip(sizes, shares, strict=True))
        cfg = dataclasses.replace(cfg, llm_sizes=sizes)
    try:
        if capacity_bytes >= 0 or not resident_first:  # with auto, checked once the capacity is known
            cfg.check()
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise click.UsageError(f"--device {device}: torch sees no CUDA device here; use --device cpu")
    from rota_demo.memory import auto_capacity

    how = f"--capacity {capacity}: every switch parks" if capacity_bytes == 0 else f"--capacity {capacity}"
    if capacity_bytes < 0:
        capacity_bytes, how = auto_capacity(device, groups, elastic)
    cfg = dataclasses.replace(cfg, capacity_bytes=capacity_bytes, capacity_how=how)
    try:
        cfg.check()
    except RotaError as exc:
        raise click.UsageError(str(exc)) from None
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    last = [0.0]

    def progress(line: str) -> None:
        now = time.monotonic()
        if "step" not in line or now - last[0] > 1.0:  # at most one step line a second
            last[0] = now
            click.echo(f"{now - t0:6.1f}s  {line}", err=True)

    states = ", ".join(f"{cfg.job_size(j).trainer_state_bytes / 1e6:.1f}" for j in ("rl-a", "rl-b", "sft"))
    what = "trainer + sampler" if engine == "toy" else f"trainer + {engine} engine" + (
        " (transformers stand-in, not an inference engine)" if engine == "hf" else "")
    click.echo(f"rota demo: 3 jobs x ({what}), {steps} steps, {groups} group(s), device {device}, "
               f"trainer state {states} MB; capacity {how}", err=True)
    plan = host_memory_plan(cfg)
    click.echo(plan.describe(), err=True)
    try:
        cfg = prepare_demo(cfg, progress)  # the plan's check, and the checkpoints' paths for the report
        results = run_modes(cfg, progress)
    except (HostMemoryShort, DeviceMemoryShort) as exc:  # refused before any worker started, not an OOM mid-run
        raise click.ClickException(str(exc)) from None
    except WorkerFailed as exc:  # a worker's error (its traceback printed above by its process): nothing written
        raise click.ClickException(f"{exc}; nothing written to {out_dir}") from None
    except KeyboardInterrupt:  # Ctrl-C: the workers are stopped by now; no traceback, nothing written
        click.echo("rota demo: interrupted; every worker stopped, nothing written", err=True)
        sys.exit(130)
    summary = summarize(cfg, results)
    write_json(summary, out_dir / "demo.json")
    timeline_png(results, out_dir / "demo-timeline.png", summary.get("curve_meaning"))
    click.echo(table(summary))
    click.echo(f"\nwrote {out_dir / 'demo.json'} and {out_dir / 'demo-timeline.png'}")
    failed = failures_line(summary)
    if failed:  # the figures above are not the switch rota promises: never a quiet success
        raise click.ClickException(failed + f" (every failure is in {out_dir / 'demo.json'}, timesliced.failures)")


def engine_shares(text: str) -> tuple[float, float, float] | None:
    """``--engine-memory``: the three jobs' engine shares (rl-a, rl-b, sft), from one fraction or three; None when
    not given. A share is vLLM's ``gpu_memory_utilization``: above 0, and at most 0.95 (vLLM's own limit is 1, but
    the CUDA contexts beside it need room)."""
    if not text.strip():
        return None
    try:
        values = [float(part) for part in text.split(",")]
    except ValueError:
        raise click.UsageError(f"--engine-memory {text!r}: give fractions of the device, one for every job (0.2) "
                               "or three for rl-a,rl-b,sft (0.2,0.25,0.3)") from None
    if len(values) not in (1, 3):
        raise click.UsageError(f"--engine-memory {text!r}: one fraction for every job, or three (rl-a,rl-b,sft); "
                               f"got {len(values)}")
    if not all(0 < v <= 0.95 for v in values):  # NaN and inf fail too
        raise click.UsageError(f"--engine-memory {text!r}: each share must be above 0 and at most 0.95 of the device")
    return (values[0],) * 3 if len(values) == 1 else (values[0], values[1], values[2])
