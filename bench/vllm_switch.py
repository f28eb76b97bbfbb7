"""A vLLM engine's park and restore: rota's (``rota_vllm.track``, weights in rota's pinned pool) against vLLM's own
level-1 sleep and the pinned-copy floor, in one run, on Hugging Face snapshots built here.

For each ``--shapes`` entry (Qwen3 shapes: 0.6B, 1.7B, 4B, 8B) it builds a snapshot (random bf16 weights from the
model's config, ``save_pretrained``: real safetensors files, loaded by vLLM with its default loader), starts
``vllm.LLM(model=snapshot, enable_sleep_mode=True, skip_tokenizer_init=True)`` in this process and measures:

* **floor**: a bare copy of every parameter storage into a pre-pinned host buffer and back, on a side stream,
  one sync at the end (inside the engine's worker, through ``collective_rpc``);
* **vLLM level 1**: ``llm.sleep(level=1)`` / ``llm.wake_up()``, ``--cycles`` times (the first sleep apart: vLLM
  allocates its host backup then);
* **rota**: ``rota_vllm.track(gpu, llm)`` (``backup="rota"``), then ``gpu.park()`` / ``gpu.restore()``
  ``--cycles`` times, the first park ``--first-after`` seconds after ``track`` (a short first turn: the pool is
  still being pinned). The seconds are those of the adapter's hooks (``gpu.stats``);
* after every park: NVML of this process (must be back to its CUDA context plus what the KV-cache-free engine
  keeps) and the device's used memory; after every restore: greedy tokens equal to those before any park;
* **fresh-mapping probe** (after ``untrack``): a level-2 sleep, the weights woken alone, then a pinned pool's copy
  into them (at once, after a device-side write, after a pause, after the KV cache's wake), and the same copy
  again: where a restore loses time;
* with ``--pipelined``, last: the sleep and wake done by hand, allocation by allocation, copies overlapping the
  unmapping and mapping (``bench/vllm_pipelined.py``): whether a restore through vLLM's pool can keep to 1.2x.

A park or restore that fails, or tokens that differ, is counted in ``failures`` and the run exits 1 naming it.
Ratios: median of the cycles after the first over the floor's median, and the first apart. JSON goes to
``--out`` (default bench/results/vllm-switch-cuda.json). Needs a CUDA device and vllm (see
bench/stage_wheels.py for the device machine).

    python3 bench/vllm_switch.py --shapes 0.6B,4B --cycles 4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core (and its worker) in this process
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("ROTA_RESIDUE_MAX_BYTES", "0")  # NVML is read here instead, per park

import torch

GB = 10**9
MIB = 1 << 20
SHAPES = {  # Qwen3 configs (hidden, intermediate, layers, heads, kv heads, tied embeddings)
    "0.6B": (1024, 3072, 28, 16, 8, True),
    "1.7B": (2048, 6144, 28, 16, 8, True),
    "4B": (2560, 9728, 36, 32, 8, True),
    "8B": (4096, 12288, 36, 32, 8, False),
}


def say(msg: str) -> None:
    print(f"[vllm-switch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_snapshot(shape: str, root: Path) -> Path:
    """A Qwen3 snapshot of ``shape`` with random bf16 weights (seeded), saved once under ``root``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    out = root / f"qwen3-{shape}"
    if (out / "config.json").exists():
        return out
    hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    cfg = Qwen3Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv, head_dim=128, vocab_size=151936, max_position_embeddings=4096,
                      tie_word_embeddings=tied, torch_dtype="bfloat16", bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return out


def nvml_of_this_process() -> int | None:
    """Device bytes NVML shows for this pid (None if NVML cannot say)."""
    try:
        import pynvml
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid():
                return int(p.usedGpuMemory)
        return 0
    except Exception:  # no NVML here: the device-wide figure is still recorded
        return None


def device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def floor_on_worker(worker: Any, repeats: int) -> dict[str, Any]:
    """Runs in the vLLM worker: bare pinned copies of every parameter storage, out and back (the floor)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for p in worker.model_runner.model.parameters():
        s = p.detach().untyped_storage()
        seen.setdefault(s.data_ptr(), s)
    devs = [torch.empty(0, dtype=torch.uint8, device=s.device).set_(s) for s in seen.values()]
    hosts = [torch.empty(d.numel(), dtype=torch.uint8, pin_memory=True) for d in devs]
    stream = torch.cuda.Stream()
    d2h, h2d = [], []
    for _ in range(repeats):
        for out, pairs in ((d2h, zip(hosts, devs, strict=True)), (h2d, zip(devs, hosts, strict=True))):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for dst, src in pairs:
                    dst.copy_(src, non_blocking=True)
            stream.synchronize()
            out.append(time.perf_counter() - t0)
    return {"bytes": sum(d.numel() for d in devs), "d2h": d2h, "h2d": h2d}


def recopy_on_worker(worker: Any) -> float:
    """Runs in the vLLM worker just after a restore: rota's pool copied into the weights once more, as the
    restore copies them (the same bytes, into memory the restore has just written), timed. Why: the restore's
    own copy into memory vLLM had just mapped again ran at half the floor on the H200 (and so did vLLM's
    level-1 wake), while the floor into the same addresses, awake, did not; this tells a first write into
    freshly mapped memory from the copy."""
    from rota_vllm import worker_stash

    torch.cuda.synchronize()
    return worker_stash(worker).copy_back()


PROBE = "_rota_bench_probe_stash"


def probe_save_on_worker(worker: Any) -> float:
    """Runs in the worker: a stash of the bench's own (not the tracker's) saves the weights; seconds."""
    from rota_vllm import WeightStash

    stash = getattr(worker, PROBE, None)
    if stash is None:
        stash = WeightStash(worker.model_runner.get_model())
        stash.pool.wait()
        setattr(worker, PROBE, stash)
    return stash.save()


def probe_load_on_worker(worker: Any, mode: str) -> dict[str, float]:
    """Runs in the worker after ``wake_up(tags=["weights"])`` of a level-2 sleep: the pool copied into the weights,
    then copied in once more; seconds of each. ``mode``: ``pretouch`` writes every weight storage on the device first
    (``zero_``: the first write into the freshly mapped memory, by the SMs); ``settle`` waits 0.2 s first (work
    the driver may still do on memory it has just mapped, e.g. clearing it); ``plain`` and ``kv_first`` (the KV
    cache was woken before) do neither."""
    stash = getattr(worker, PROBE)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if mode == "pretouch":
        for s in stash.storages:
            torch.empty(0, dtype=torch.uint8, device=s.device).set_(s).zero_()
        torch.cuda.synchronize()
    elif mode == "settle":
        time.sleep(0.2)
    before_s = time.perf_counter() - t0
    load_s = stash.load()
    return {"before_s": before_s, "load_s": load_s, "recopy_s": stash.copy_back()}


def probe_drop_on_worker(worker: Any) -> None:
    if hasattr(worker, PROBE):
        delattr(worker, PROBE)


PROBE_MODES = ("plain", "settle", "kv_first", "pretouch")


def fresh_mapping_probe(llm: Any, cycles: int, check: Any) -> list[dict[str, Any]]:
    """Where a restore's copy into vLLM's freshly mapped weights loses time (issue 41): level-2 sleep, wake the
    weights alone (timed), then the copy from a pinned pool (see :func:`probe_load_on_worker` for each mode) and
    the same copy again; the KV cache woken after (before, in ``kv_first``). Each cycle's tokens are checked."""
    rows = []
    for i in range(max(cycles, len(PROBE_MODES))):
        mode = PROBE_MODES[i % len(PROBE_MODES)]
        save_s = llm.collective_rpc(probe_save_on_worker)[0]
        t = time.perf_counter()
        llm.sleep(level=2)
        sleep_s = time.perf_counter() - t
        t = time.perf_counter()
        llm.wake_up(tags=["weights"])
        wake_weights_s = time.perf_counter() - t
        wake_kv_s = 0.0
        if mode == "kv_first":
            t = time.perf_counter()
            llm.wake_up(tags=["kv_cache"])
            wake_kv_s = time.perf_counter() - t
        got = llm.collective_rpc(probe_load_on_worker, args=(mode,))[0]
        if mode != "kv_first":
            t = time.perf_counter()
            llm.wake_up(tags=["kv_cache"])
            wake_kv_s = time.perf_counter() - t
        rows.append({"mode": mode, "save_s": save_s, "sleep_level2_s": sleep_s, "wake_weights_s": wake_weights_s,
                     **got, "wake_kv_s": wake_kv_s})
        check("the fresh-mapping probe", "probe", i)
    llm.collective_rpc(probe_drop_on_worker)
    return rows


def x(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def ratio(xs: list[float], floor: float) -> float | None:
    return None if not xs else statistics.median(xs) / floor


def rounded(steps: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in steps.items()}


def run_shape(shape: str, args: argparse.Namespace, failures: list[str]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    import rota
    import rota_vllm

    snapshot = build_snapshot(shape, Path(args.snapshots))
    torch.cuda.init()
    torch.empty(1, device="cuda")
    context = nvml_of_this_process()
    t0 = time.perf_counter()
    llm = LLM(model=str(snapshot), enable_sleep_mode=True, skip_tokenizer_init=True, seed=0, dtype="bfloat16",
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=not args.cuda_graphs)
    start_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=16, temperature=0.0, detokenize=False)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 164 + 7 * i))} for i in range(8)]

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    want = generate()
    awake_nvml, awake_used = nvml_of_this_process(), device_used()
    say(f"{shape}: engine up in {start_s:.1f} s, NVML of this process {awake_nvml} B (context {context} B)")
    floor = llm.collective_rpc(floor_on_worker, args=(args.repeats,))[0]
    f_d2h, f_h2d = statistics.median(floor["d2h"]), statistics.median(floor["h2d"])
    wbytes = floor["bytes"]
    say(f"{shape}: floor {wbytes / GB:.2f} GB: D2H {f_d2h:.4f} s, H2D {f_h2d:.4f} s")

    def timed_generate() -> tuple[list[list[int]], float]:
        t = time.perf_counter()
        out = generate()
        return out, time.perf_counter() - t

    warm_s = statistics.median(timed_generate()[1] for _ in range(3))  # the same requests, engine warm
    # the first requests after vLLM's own wake, after rota's restore, after the probe's
    first_after: dict[str, list[float]] = {"vllm": [], "rota": [], "probe": [], "pipelined": []}

    def check(what: str, who: str, i: int) -> None:
        got, seconds = timed_generate()  # the first requests after the wake: an empty KV cache and prefix cache
        first_after[who].append(seconds)
        if got != want:
            failures.append(f"{shape}: greedy tokens after {what} #{i} differ from those before any park")

    vllm_sleep, vllm_wake, vllm_nvml = [], [], []
    for i in range(args.cycles):
        t = time.perf_counter()
        llm.sleep(level=1)
        vllm_sleep.append(time.perf_counter() - t)
        vllm_nvml.append(nvml_of_this_process())
        t = time.perf_counter()
        llm.wake_up()
        vllm_wake.append(time.perf_counter() - t)
        check("vLLM's wake", "vllm", i)
    say(f"{shape}: vLLM level 1: sleep {[round(x, 3) for x in vllm_sleep]} s, wake {[round(x, 3) for x in vllm_wake]}")

    gpu = rota.connect(group=f"vllm-switch-{shape}", tenant=f"engine-{shape}")
    tracked = rota_vllm.track(gpu, llm)
    time.sleep(args.first_after)
    park, restore, park_nvml, park_used, park_steps, restore_steps, recopy = [], [], [], [], [], [], []
    for i in range(args.cycles):
        try:
            gpu.park()
            park.append(gpu.stats.parks[-1].seconds)
            park_steps.append(dict(tracked.last_phases))
            park_nvml.append(nvml_of_this_process())
            park_used.append(device_used())
            gpu.restore()
            restore.append(gpu.stats.restores[-1].seconds)
            restore_steps.append(dict(tracked.last_phases))
            recopy.append(llm.collective_rpc(recopy_on_worker)[0])
        except Exception as e:  # counted, named, and the run fails
            failures.append(f"{shape}: rota cycle {i}: {type(e).__name__}: {e}")
            traceback.print_exc()
            break
        check("rota's restore", "rota", i)
    failures += [f"{shape}: {kind} failed: {msg}" for kind, _, msg in gpu.stats.failures]
    say(f"{shape}: rota: park {[round(x, 3) for x in park]} s, restore {[round(x, 3) for x in restore]} s, "
        f"NVML after park {[None if b is None else b // MIB for b in park_nvml]} MiB")
    if restore_steps:
        say(f"{shape}: rota's last park by step {rounded(park_steps[-1])}; last restore {rounded(restore_steps[-1])}")
    say(f"{shape}: the same requests take {warm_s:.3f} s warm, {[round(x, 3) for x in first_after['rota']]} s first "
        f"after a restore; a second copy into the restored weights {[round(x, 4) for x in recopy]} s")
    tracked.untrack()
    gpu.close()
    probe: list[dict[str, Any]] = []
    try:
        probe = fresh_mapping_probe(llm, args.cycles, check)
    except Exception as e:  # counted, named, and the run fails
        failures.append(f"{shape}: the fresh-mapping probe: {type(e).__name__}: {e}")
        traceback.print_exc()
    for r in probe:
        say(f"{shape}: probe ({r['mode']}): wake weights {r['wake_weights_s']:.4f} s, before the copy "
            f"{r['before_s']:.4f} s, copy in {r['load_s']:.4f} s, again {r['recopy_s']:.4f} s (floor {f_h2d:.4f} s), "
            f"wake KV cache {r['wake_kv_s']:.4f} s")
    pipelined = pipelined_probe(llm, shape, args, check, failures, f_d2h, f_h2d) if args.pipelined else None
    row = {
        "shape": shape, "snapshot": str(snapshot), "weights_bytes": wbytes, "engine_start_s": start_s,
        "context_bytes": context, "awake_nvml_bytes": awake_nvml, "awake_device_used": awake_used,
        "floor_d2h_s": f_d2h, "floor_h2d_s": f_h2d, "floor_d2h_gbps": wbytes / f_d2h / GB,
        "floor_h2d_gbps": wbytes / f_h2d / GB,
        "warm_generate_s": warm_s, "first_generate_after_wake_s": first_after["vllm"],
        "first_generate_after_restore_s": first_after["rota"],
        "vllm_level1": {"sleep_s": vllm_sleep, "wake_s": vllm_wake, "nvml_asleep": vllm_nvml,
                        "first_sleep_x_floor": vllm_sleep[0] / f_d2h if vllm_sleep else None,
                        "sleep_x_floor": ratio(vllm_sleep[1:], f_d2h), "wake_x_floor": ratio(vllm_wake, f_h2d)},
        "rota": {"park_s": park, "restore_s": restore, "park_steps_s": park_steps, "restore_steps_s": restore_steps,
                 "recopy_after_restore_s": recopy, "recopy_x_floor": ratio(recopy, f_h2d),
                 "nvml_after_park": park_nvml,
                 "device_used_after_park": park_used,
                 "first_park_x_floor": park[0] / f_d2h if park else None, "first_after_s": args.first_after,
                 "park_x_floor": ratio(park[1:], f_d2h), "restore_x_floor": ratio(restore, f_h2d),
                 "residue_after_park_bytes": [None if b is None or context is None else b - context
                                              for b in park_nvml]},
        "fresh_mapping_probe": probe, "first_generate_after_probe_s": first_after["probe"],
        "pipelined_probe": pipelined, "first_generate_after_pipelined_s": first_after["pipelined"],
    }
    return row


def pipelined_probe(llm: Any, shape: str, args: argparse.Namespace, check: Any, failures: list[str], f_d2h: float,
                    f_h2d: float) -> dict[str, Any] | None:
    """``--pipelined``: sleep and wake by hand, allocation by allocation (``bench/vllm_pipelined.py``), last: a
    failure there may leave the engine unusable."""
    import vllm_pipelined

    try:
        got = vllm_pipelined.probe(llm, args.cycles, check, nvml_of_this_process)
    except Exception as e:  # counted, named, and the run fails
        failures.append(f"{shape}: the pipelined probe: {type(e).__name__}: {e}")
        traceback.print_exc()
        return None
    parks, restores = [r["park_s"] for r in got["park"]], [r["restore_s"] for r in got["restore"]]
    got.update(park_x_floor=ratio(parks[1:], f_d2h), restore_x_floor=ratio(restores, f_h2d),
               first_park_x_floor=parks[0] / f_d2h if parks else None)
    say(f"{shape}: pipelined probe ({got['bytes'] / GB:.2f} GB in {got['weights_allocations']} weights allocations, "
        f"{got['other_allocations']} others): park {[round(x, 4) for x in parks]} s, restore "
        f"{[round(x, 4) for x in restores]} s, NVML after park "
        f"{[None if b is None else b // MIB for b in got['nvml_after_park']]} MiB; last park by step "
        f"{rounded(got['park'][-1])}, last restore {rounded(got['restore'][-1])}")
    return got


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="0.6B,4B", help=f"comma-separated, of {', '.join(SHAPES)} (default 0.6B,4B)")
    ap.add_argument("--cycles", type=int, default=4, help="park/restore cycles per engine and way (default 4)")
    ap.add_argument("--repeats", type=int, default=5, help="floor copies each way (default 5)")
    ap.add_argument("--first-after", type=float, default=0.5, help="seconds from track() to the first park (0.5)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="vLLM's share of the device (0.3)")
    ap.add_argument("--cuda-graphs", action="store_true", help="enforce_eager=False (CUDA graphs captured)")
    ap.add_argument("--snapshots", default="/tmp/rota-vllm-snapshots", help="where the built snapshots are kept")
    ap.add_argument("--out", default="bench/results/vllm-switch-cuda.json", help="JSON path")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per shape's process (default 900)")
    ap.add_argument("--pipelined", action="store_true",
                    help="last, a probe: sleep and wake by hand, allocation by allocation (bench/vllm_pipelined.py)")
    ap.add_argument("--one", choices=sorted(SHAPES), help=argparse.SUPPRESS)  # the per-shape child
    args = ap.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        ap.error(f"--shapes {args.shapes!r}: {bad or 'none'} not among {', '.join(SHAPES)}")
    if args.cycles < 2:
        ap.error(f"--cycles {args.cycles}: pass 2 or more (the first cycle is reported apart)")
    if not torch.cuda.is_available():
        print("vllm_switch: needs a CUDA device (vLLM's sleep mode frees nothing on CPU)", file=sys.stderr)
        return 2
    try:
        import vllm
    except ImportError as e:
        print(f"vllm_switch: vllm is not importable ({e}); on the device machine stage it with "
              "bench/stage_wheels.py", file=sys.stderr)
        return 2
    if args.one:  # a child: one engine per process (vLLM does not give all of a device back in-process)
        failures: list[str] = []
        try:
            row = run_shape(shape=args.one, args=args, failures=failures)
        except Exception as e:
            row = None
            failures.append(f"{args.one}: {type(e).__name__}: {e}")
            traceback.print_exc()
        Path(args.out).write_text(json.dumps({"row": row, "failures": failures}) + "\n")
        return 0
    failures, rows = [], []
    for shape in shapes:
        part = Path(args.out).with_suffix(f".{shape}.part.json")
        cmd = [sys.executable, __file__, "--one", shape, "--out", str(part)]
        for flag in ("cycles", "repeats", "first_after", "gpu_memory_utilization", "snapshots"):
            cmd += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        cmd += ["--cuda-graphs"] if args.cuda_graphs else []
        cmd += ["--pipelined"] if args.pipelined else []
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        rc = subprocess.run(cmd, timeout=args.timeout).returncode
        try:
            got = json.loads(part.read_text())
            part.unlink()
        except (OSError, ValueError):
            got = {"row": None, "failures": [f"{shape}: the engine's process exited {rc} with no result"]}
        rows += [got["row"]] if got["row"] else []
        failures += got["failures"]
    out = {"bench": "vllm_switch", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "vllm": vllm.__version__, "host": platform.node(), "commit": os.environ.get("ROTA_COMMIT", "unknown"),
           "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "args": vars(args), "rows": rows,
           "failures": failures}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    for r in rows:
        v, o = r["vllm_level1"], r["rota"]
        say(f"{r['shape']} ({r['weights_bytes'] / GB:.2f} GB of weights): rota park {x(o['park_x_floor'])} / "
            f"restore {x(o['restore_x_floor'])} the floor (first park {x(o['first_park_x_floor'])}); vLLM level 1 "
            f"sleep {x(v['sleep_x_floor'])} / wake {x(v['wake_x_floor'])} (first sleep {x(v['first_sleep_x_floor'])})")
        if r.get("pipelined_probe"):
            q = r["pipelined_probe"]
            say(f"{r['shape']}: by hand, allocation by allocation: park {x(q['park_x_floor'])} / restore "
                f"{x(q['restore_x_floor'])} the floor (first park {x(q['first_park_x_floor'])})")
    if failures:
        print(f"vllm_switch: {len(failures)} failure(s); the first: {failures[0]}", file=sys.stderr)
        return 1
    say(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
