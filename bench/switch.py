"""Switch cost: park and restore through rota_fsdp against the raw pinned-copy floor.

For a tenant of S bytes (``--tensors`` model-like tensors: big weight matrices and
small bias/norm vectors), measures in one run:

* floor: a bare ``non_blocking`` copy of every tensor into a pre-pinned host buffer
  (device->host) and back (host->device) on a side stream, one sync at the end;
* park and restore through the adapter's real API: ``rota_fsdp.track`` on a module
  holding those tensors, parked by ``gpu.park()`` and restored by ``gpu.turn()`` (the
  seconds are those of the rota_park / rota_restore hooks, from ``gpu.stats``);
* ratio = park / floor(D2H) and restore / floor(H2D), on the median of ``--repeats``;
* overlapped switch: ``rota_fsdp.switch`` parks tenant A while restoring tenant B
  (two streams), reported as combined GB/s (2 S / seconds), next to the same
  overlap done with bare copies;
* pool setup: allocating (pinning) the host pool, off the critical path, reported
  apart.

Every restore is checked bit-for-bit (per-tensor integer checksums). Needs only torch,
rota-core and rota-adapter-fsdp; starts an in-process orchestrator on loopback.

    python bench/switch.py --device cuda --sizes 1GB,4GB,20GB --dtype bf16 --tensors 800
    python bench/switch.py --device cpu                 # small sizes, seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time

import torch

# Both tenants live in this one process, so the allocator's process-wide total after
# parking one still counts the other's resident state: the per-park residue check
# (a per-process measure) would fault every park here. Residue is measured by
# bench/verify_cost.py and bench/agent_switch.py, one tenant per process.
os.environ.setdefault("ROTA_RESIDUE_MAX_BYTES", "0")

from rota_torch import HostPool, env_verify

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in sorted(UNITS, key=len, reverse=True):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def say(msg: str) -> None:
    print(f"[switch {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Bench:
    def __init__(self, device: torch.device, dtype: torch.dtype, tensors: int, repeats: int) -> None:
        self.device, self.dtype, self.n, self.repeats = device, dtype, tensors, repeats
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stream2 = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.release_cached = True
        self.settle = 0.0  # seconds between a park and the restore after it (--settle)

    # ------------------------------------------------------------- tensors

    def make_tensors(self, nbytes: int, seed: int) -> list[torch.Tensor]:
        """Model-like: three big matrices for every small vector, ``nbytes`` in all."""
        weights = [1.0 if i % 4 != 3 else 1.0 / 64 for i in range(self.n)]
        item = torch.empty(0, dtype=self.dtype).element_size()
        elems = nbytes // item
        counts = [max(64, int(elems * w / sum(weights)) // 64 * 64) for w in weights]
        gen = torch.Generator(device=self.device).manual_seed(seed)
        out = []
        for c in counts:
            t = torch.empty(c, dtype=self.dtype, device=self.device)
            t.uniform_(-1, 1, generator=gen)
            out.append(t)
        sync(self.device)
        return out

    @staticmethod
    def checksum(tensors: list[torch.Tensor]) -> torch.Tensor:
        iv = INT_VIEW[tensors[0].element_size()]
        return torch.stack([t.view(iv).sum(dtype=torch.int64) for t in tensors]).cpu()

    # --------------------------------------------------------------- floor

    def _copies(self, pairs: list[tuple[torch.Tensor, torch.Tensor]], stream: object | None) -> None:
        if stream is None:
            for dst, src in pairs:
                dst.copy_(src)
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)

    def floor_pairs(self, tensors: list[torch.Tensor], host: HostPool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(host piece, device bytes) for a bare copy of every tensor into the pre-pinned pool."""
        pairs, off = [], 0
        for t in tensors:
            b = t.view(torch.uint8)
            at = 0
            for piece in host.pieces(off, b.numel()):
                pairs.append((piece, b[at:at + piece.numel()]))
                at += piece.numel()
            off += (b.numel() + 511) // 512 * 512
        return pairs

    def time_floor(self, tensors: list[torch.Tensor], host: HostPool) -> tuple[list[float], list[float]]:
        pairs = self.floor_pairs(tensors, host)
        d2h, h2d = [], []
        for _ in range(self.repeats):
            sync(self.device)
            t0 = time.perf_counter()
            self._copies(pairs, self.stream)
            sync(self.device)
            d2h.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            self._copies([(d, h) for h, d in pairs], self.stream)
            sync(self.device)
            h2d.append(time.perf_counter() - t0)
        return d2h, h2d

    def time_driver_floor(self, nbytes: int, host: HostPool) -> tuple[list[float], list[float]]:
        """The floor of a switch that hands its memory back to the driver (CUDA only): host->device into one
        block just asked of the driver (the allocation timed), and device->host then the block freed back
        (``empty_cache`` timed). Why: a restore writes into memory the driver has just mapped, which a copy
        into the tenant's own resident tensors (the plain floor) never does."""
        d2h, h2d = [], []
        for _ in range(self.repeats):
            gc.collect()
            torch.cuda.empty_cache()
            sync(self.device)
            t0 = time.perf_counter()
            block = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            pairs = self.floor_pairs([block], host)
            self._copies([(d, h) for h, d in pairs], self.stream)
            sync(self.device)
            h2d.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            self._copies(pairs, self.stream)
            sync(self.device)
            del pairs, block
            torch.cuda.empty_cache()
            d2h.append(time.perf_counter() - t0)
        return d2h, h2d

    def time_floor_overlap(self, a: list[torch.Tensor], host_a: HostPool, b: list[torch.Tensor],
                           host_b: HostPool) -> list[float]:
        out_pairs = self.floor_pairs(a, host_a)
        in_pairs = [(d, h) for h, d in self.floor_pairs(b, host_b)]
        self._copies(self.floor_pairs(b, host_b), self.stream)  # host_b holds b: restoring it changes nothing
        sync(self.device)
        times = []
        for _ in range(self.repeats):
            sync(self.device)
            t0 = time.perf_counter()
            self._copies(out_pairs, self.stream)
            self._copies(in_pairs, self.stream2)
            sync(self.device)
            times.append(time.perf_counter() - t0)
        return times


def run_size(bench: Bench, nbytes: int, endpoint: str) -> dict[str, object]:
    import rota
    import rota_fsdp

    dev = bench.device
    say(f"size {nbytes / 1e9:.3f} GB: allocating tenant A ({bench.n} tensors) on {dev}")
    a = bench.make_tensors(nbytes, seed=1)
    real = sum(t.numel() * t.element_size() for t in a)
    model_a = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in a])
    gpu_a = rota.connect(group="bench-a", tenant="bench-a", endpoint=endpoint)
    tracked_a = rota_fsdp.track(gpu_a, model_a, tags=("weights",), device=dev, pool_bytes=0,
                                 release_cached=bench.release_cached)
    say("pinning tenant A's host pool (off the critical path)")
    setup_a = tracked_a.prepare(real + 512 * bench.n)
    say(f"  pool setup {setup_a:.3f} s")
    want_a = bench.checksum(a)

    say("floor: bare copies into the same pre-pinned pool")
    fd2h, fh2d = bench.time_floor(a, tracked_a.parker.pool)
    assert torch.equal(bench.checksum(a), want_a)
    driver: tuple[list[float], list[float]] = ([], [])
    if dev.type == "cuda" and bench.release_cached:
        say("driver floor: the same copies into memory just asked of the driver, and back before freeing it")
        driver = bench.time_driver_floor(real, tracked_a.parker.pool)  # A is resident: the pool is scratch

    say(f"park/restore through rota_fsdp, {bench.repeats} times")
    park, restore, identical = [], [], True
    park_phases: list[dict[str, float]] = []
    restore_phases: list[dict[str, float]] = []
    for _ in range(bench.repeats):
        gpu_a.park()
        park.append(gpu_a.stats.parks[-1].seconds)
        park_phases.append(dict(tracked_a.parker.last_phases, hooks_total=park[-1]))
        freed = all(t.untyped_storage().nbytes() == 0 for t in a)
        time.sleep(bench.settle)
        with gpu_a.turn():
            pass
        restore.append(gpu_a.stats.restores[-1].seconds)
        restore_phases.append(dict(tracked_a.parker.last_phases, hooks_total=restore[-1]))
        identical &= freed and torch.equal(bench.checksum(a), want_a)
    say(f"  park {statistics.median(park):.4f} s  restore {statistics.median(restore):.4f} s  "
        f"bit-identical {identical}")

    say("overlap: tenant B parked, then park A while restoring B")
    b = bench.make_tensors(nbytes, seed=2)
    model_b = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in b])
    gpu_b = rota.connect(group="bench-b", tenant="bench-b", endpoint=endpoint)
    tracked_b = rota_fsdp.track(gpu_b, model_b, tags=("weights",), device=dev, pool_bytes=0,
                                 release_cached=bench.release_cached)
    setup_b = tracked_b.prepare(real + 512 * bench.n)
    want_b = bench.checksum(b)
    floor_overlap = bench.time_floor_overlap(a, tracked_a.parker.pool, b, tracked_b.parker.pool)
    gpu_b.park()
    overlap = []
    out, into = (tracked_a, want_a, a), (tracked_b, want_b, b)
    for _ in range(bench.repeats):
        res_out, res_in = rota_fsdp.switch(park=out[0], restore=into[0])
        overlap.append(res_out.seconds)
        identical &= res_out.bytes_moved == res_in.bytes_moved == real
        identical &= torch.equal(bench.checksum(into[2]), into[1])
        out, into = into, out
    if out[0].parked:  # leave both resident for untrack
        out[0].restore()
    if into[0].parked:
        into[0].restore()
    tracked_a.untrack()
    tracked_b.untrack()
    gpu_a.close()
    gpu_b.close()
    del model_a, model_b, a, b, tracked_a, tracked_b, out, into
    gc.collect()  # a tracked model and its parker refer to each other: without this the next size ran beside them
    if dev.type == "cuda":
        torch.cuda.empty_cache()

    med = statistics.median
    driver_d2h, driver_h2d = (med(driver[0]), med(driver[1])) if driver[0] else (None, None)
    row = {
        "size_bytes": real,
        "floor_d2h_s": med(fd2h), "floor_h2d_s": med(fh2d),
        "park_s": med(park), "restore_s": med(restore),
        "park_ratio": med(park) / med(fd2h), "restore_ratio": med(restore) / med(fh2d),
        "floor_d2h_gbps": real / med(fd2h) / 1e9, "floor_h2d_gbps": real / med(fh2d) / 1e9,
        "park_gbps": real / med(park) / 1e9, "restore_gbps": real / med(restore) / 1e9,
        "overlap_s": med(overlap), "overlap_gbps": 2 * real / med(overlap) / 1e9,
        "floor_overlap_gbps": 2 * real / med(floor_overlap) / 1e9,
        # memory handed back to the driver at park and asked again at restore (None with the cache kept)
        "floor_driver_d2h_s": driver_d2h, "floor_driver_h2d_s": driver_h2d,
        "park_ratio_driver": med(park) / driver_d2h if driver_d2h else None,
        "restore_ratio_driver": med(restore) / driver_h2d if driver_h2d else None,
        "pool_setup_s": setup_a + setup_b,
        # where a park's and a restore's time goes (medians over the repeats): the parker's phases, and
        # hooks_total, what the client timed (the parker plus the adapter's residue readings)
        "park_phases_s": _median_phases(park_phases), "restore_phases_s": _median_phases(restore_phases),
        # every repeat's phases: the first restore after a park that freed the bench's own allocations has
        # differed from later ones by up to 25 ms at 20 GB, which the medians hide
        "park_phases_samples": park_phases, "restore_phases_samples": restore_phases,
        "bit_identical": bool(identical),
        "samples": {"floor_d2h": fd2h, "floor_h2d": fh2d, "park": park, "restore": restore, "overlap": overlap,
                    "floor_overlap": floor_overlap, "floor_driver_d2h": driver[0], "floor_driver_h2d": driver[1]},
    }
    if driver_d2h:
        say(f"  against the driver floor ({row['floor_driver_d2h_s']:.4f} s / {row['floor_driver_h2d_s']:.4f} s): "
            f"park {row['park_ratio_driver']:.2f}x, restore {row['restore_ratio_driver']:.2f}x")
    say(f"  overlapped switch {row['overlap_gbps']:.1f} GB/s (bare copies {row['floor_overlap_gbps']:.1f} GB/s)")
    return row


def _median_phases(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s.get(k, 0.0) for s in samples) for k in samples[0]} if samples else {}


def first_park(bench: Bench, nbytes: int, endpoint: str, turn_s: float, floor_d2h_s: float) -> dict[str, object]:
    """A tenant tracked with the default host pool (reserved in the background at ``track``), one turn of
    ``turn_s`` seconds, then its first park: what a job whose first turn is short pays, against the floor."""
    import rota
    import rota_fsdp

    say(f"first park at {nbytes / 1e9:.3f} GB after a {turn_s:g} s first turn (pool pinned in the background)")
    c = bench.make_tensors(nbytes, seed=3)
    real = sum(t.numel() * t.element_size() for t in c)
    want = bench.checksum(c)
    model = torch.nn.ParameterList([torch.nn.Parameter(t, requires_grad=False) for t in c])
    gpu = rota.connect(group="bench-first", tenant="bench-first", endpoint=endpoint)
    t0 = time.perf_counter()
    tracked = rota_fsdp.track(gpu, model, tags=("weights",), device=bench.device, release_cached=bench.release_cached)
    with gpu.turn():
        time.sleep(turn_s)
    park_at = time.perf_counter() - t0
    gpu.park()
    seconds = gpu.stats.parks[-1].seconds
    phases = dict(tracked.parker.last_phases)
    pool = tracked.parker.pool
    pool.wait()
    with gpu.turn():
        pass
    identical = torch.equal(bench.checksum(c), want)
    row = {"size_bytes": real, "first_turn_s": turn_s, "first_park_s": seconds,
           "first_park_ratio": seconds / floor_d2h_s, "since_track_s": time.perf_counter() - t0,
           "pin_gbps": pool.pinned_bytes / pool.pinned_seconds / 1e9 if pool.pinned_seconds else 0.0,
           "pinned_bytes": pool.pinned_bytes, "pinned_s": pool.pinned_seconds, "phases_s": phases,
           # since track(): when the park was asked for, and when the pool's background pinning ended
           "park_asked_since_track_s": park_at, "pool_pinned_since_track_s": pool.grown_at - t0,
           # how far pinning had got when the park was asked for, and when each chunk was ready (since track())
           "pinned_when_asked_bytes": sum(c.numel() for c, at in zip(pool.chunks, pool.chunk_ready_at, strict=True)
                                          if at - t0 <= park_at),
           "chunk_ready_since_track_s": [round(at - t0, 4) for at in pool.chunk_ready_at],
           "bit_identical": bool(identical), "failed": gpu.stats.failed("park") + gpu.stats.failed("restore")}
    say(f"  first park {seconds:.4f} s = {row['first_park_ratio']:.2f}x the floor; host pinned "
        f"{row['pin_gbps']:.1f} GB/s, done {row['pool_pinned_since_track_s']:.3f} s after track() (the park was "
        f"asked for at {park_at:.3f} s, {row['pinned_when_asked_bytes'] / 1e9:.1f} GB pinned by then); "
        f"phases {', '.join(f'{k} {v * 1e3:.0f} ms' for k, v in phases.items())}; bit-identical {identical}")
    tracked.untrack()
    gpu.close()
    del model, c, tracked
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict[str, object]]) -> str:
    head = (f"{'size GB':>8} {'floor D2H s':>11} {'park s':>8} {'park/fl':>7} {'floor H2D s':>11} {'restore s':>9} "
            f"{'rest/fl':>7} {'overlap GB/s':>12} {'bare ovl GB/s':>13} {'pool setup s':>12} {'identical':>9}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['size_bytes'] / 1e9:8.3f} {r['floor_d2h_s']:11.4f} {r['park_s']:8.4f} {r['park_ratio']:7.2f} "
                     f"{r['floor_h2d_s']:11.4f} {r['restore_s']:9.4f} {r['restore_ratio']:7.2f} "
                     f"{r['overlap_gbps']:12.1f} {r['floor_overlap_gbps']:13.1f} {r['pool_setup_s']:12.3f} "
                     f"{r['bit_identical']!s:>9}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default=None, help="comma-separated tenant sizes (default: 1GB,4GB,20GB on "
                    "cuda, 16MB,64MB on cpu)")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    ap.add_argument("--tensors", type=int, default=800, help="tensors per tenant (default 800)")
    ap.add_argument("--repeats", type=int, default=3, help="measurements per quantity; medians are reported")
    ap.add_argument("--keep-cache", action="store_true", help="do not hand freed device memory back to the "
                    "driver after a park (release_cached=False; faster, but only this process can reuse it)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/switch-<device>.json)")
    ap.add_argument("--settle", type=float, default=0.0, help="seconds between each park and the restore after it "
                    "(default 0: back to back). In a time-sliced group another tenant's turn lies between them; a "
                    "restore into memory the driver has only just taken back may copy slower")
    ap.add_argument("--first-turn", type=float, default=0.5, help="seconds of the first turn before the first "
                    "park of a freshly tracked tenant (its pool pinned in the background); <0 skips it")
    ns = ap.parse_args()
    if ns.device == "cuda" and not torch.cuda.is_available():
        sys.exit("switch: --device cuda but torch sees no CUDA device")
    sizes = [parse_size(s) for s in (ns.sizes or ("1GB,4GB,20GB" if ns.device == "cuda" else "16MB,64MB")).split(",")]
    device = torch.device("cuda", torch.cuda.current_device()) if ns.device == "cuda" else torch.device("cpu")
    out = ns.out or f"bench/results/switch-{ns.device}.json"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    say(f"device {device} ({name}), torch {torch.__version__}, dtype {ns.dtype}, {ns.tensors} tensors, "
        f"sizes {[f'{s / 1e9:g} GB' for s in sizes]}")

    from rota.testing import running_orchestrator

    if ns.settle < 0:
        ap.error(f"--settle {ns.settle:g}: seconds, 0 or more")
    bench = Bench(device, DTYPES[ns.dtype], ns.tensors, ns.repeats)
    bench.settle = ns.settle
    bench.release_cached = not ns.keep_cache
    rows, firsts = [], []
    with running_orchestrator() as (endpoint, _engine):
        for s in sizes:
            rows.append(run_size(bench, s, endpoint))
            if ns.first_turn >= 0:
                firsts.append(first_park(bench, s, endpoint, ns.first_turn, rows[-1]["floor_d2h_s"]))
    print()
    print(table(rows))
    for r in rows:
        if r["park_ratio_driver"] is not None:
            print(f"{r['size_bytes'] / 1e9:.1f} GB against the driver floor (memory handed back and asked again): "
                  f"park {r['park_ratio_driver']:.2f}x, restore {r['restore_ratio_driver']:.2f}x")
    for f in firsts:
        print(f"first park {f['size_bytes'] / 1e9:.1f} GB after a {f['first_turn_s']:g} s turn: {f['first_park_s']:.4f}"
              f" s = {f['first_park_ratio']:.2f}x the floor (host pinned {f['pin_gbps']:.1f} GB/s)")
    failed = sum(f["failed"] for f in firsts) + sum(0 if r["bit_identical"] else 1 for r in rows)
    result = {
        "bench": "switch", "device": str(device), "device_name": name, "torch": torch.__version__,
        "python": platform.python_version(), "host": platform.node(), "dtype": ns.dtype, "tensors": ns.tensors,
        "repeats": ns.repeats, "release_cached": bench.release_cached, "settle_s": ns.settle,
        "verify": env_verify(), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "settings": {k: os.environ.get(k) for k in ("ROTA_PIN_THREADS", "ROTA_PIN_FAULT", "ROTA_PIN_METHOD",
                                                    "PYTORCH_CUDA_ALLOC_CONF")},
        "targets": {"park_ratio_max": 1.1, "restore_ratio_max": 1.1, "overlap_gbps_min": 80.0},
        "results": rows, "first_parks": firsts, "failed": failed,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=2)
    say(f"wrote {out}")
    if failed:
        sys.exit(f"switch: {failed} failed park(s)/restore(s) or restores that were not bit-identical; see {out}")


if __name__ == "__main__":
    main()
