"""How fast this host pins memory for a host pool, by method, and what each kind of buffer copies at.

Why: a tenant's first park waits for its host pool. ``torch.empty(pin_memory=True)`` (``cudaHostAlloc``)
took 24 s for 20 GB on an H200 host, so a first turn shorter than that paid the whole reservation.
This measures, in one run, ``--gib`` GiB pinned by each method, 1 GiB at a time:

* ``hostalloc``: ``torch.empty(pin_memory=True)`` per chunk, one thread (what the pool did);
* ``hostalloc-par``: the same from ``--threads`` threads at once;
* ``register``: an anonymous ``mmap`` per chunk, its pages faulted in (zeroed) by ``--threads`` threads, then
  ``cudaHostRegister``; ``-thp`` with ``madvise(MADV_HUGEPAGE)`` first; ``-par`` registers from the threads too;
  ``-touch`` writes one byte per 4 KiB page instead of zeroing every byte (the kernel zeroes each page it faults
  in anyway, so zeroing it again doubles the host memory traffic);

and the device-to-host / host-to-device copy rate of 1 GiB into each kind, and into pageable memory.

    python bench/pin_rate.py --gib 8 --threads 8 --out bench/results
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import threading
import time

import torch

GIB = 1 << 30


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


def hostalloc(n: int, threads: int) -> list:
    out: list = [None] * n
    if threads <= 1:
        for i in range(n):
            out[i] = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)
        return out

    def work(i: int) -> None:
        out[i] = torch.empty(GIB, dtype=torch.uint8, pin_memory=True)

    _parallel(work, n, threads)
    return out


def _parallel(fn, n: int, threads: int) -> None:
    lock = threading.Lock()
    todo = list(range(n))

    def loop() -> None:
        while True:
            with lock:
                if not todo:
                    return
                i = todo.pop()
            fn(i)

    ts = [threading.Thread(target=loop) for _ in range(min(threads, n))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def _fault_in(t: torch.Tensor, touch_only: bool) -> None:
    """Fault a fresh mapping's pages in: one write per page (the fault zeroes the rest), or zeros over every byte."""
    if touch_only:
        t[::4096].fill_(0)
    else:
        t.zero_()


def _mapping(thp: bool = True) -> tuple[mmap.mmap, torch.Tensor]:
    """A fresh anonymous 1 GiB mapping (transparent huge pages asked for if ``thp``) and a uint8 view of it."""
    m = mmap.mmap(-1, GIB, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if thp and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    return m, torch.frombuffer(m, dtype=torch.uint8)


def register(n: int, threads: int, *, thp: bool, parallel_register: bool, touch_only: bool = False) -> list:
    cudart = torch.cuda.cudart()
    held = [_mapping(thp) for _ in range(n)]

    def touch(i: int) -> None:
        _fault_in(held[i][1], touch_only)
        if parallel_register:
            err = int(cudart.cudaHostRegister(held[i][1].data_ptr(), GIB, 0))
            if err:
                raise RuntimeError(f"cudaHostRegister failed: {err}")

    _parallel(touch, n, threads)
    if not parallel_register:
        for _m, t in held:
            err = int(cudart.cudaHostRegister(t.data_ptr(), GIB, 0))
            if err:
                raise RuntimeError(f"cudaHostRegister failed: {err}")
    return held


def unregister(held: list) -> None:
    cudart = torch.cuda.cudart()
    for _m, t in held:
        cudart.cudaHostUnregister(t.data_ptr())
    held.clear()


def copy_rate(host: torch.Tensor, dev: torch.Tensor, stream: torch.cuda.Stream) -> tuple[float, float]:
    """(D2H GB/s, H2D GB/s) of one copy each way, median of 3."""
    rates = []
    for direction in ("d2h", "h2d"):
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                if direction == "d2h":
                    host.copy_(dev, non_blocking=True)
                else:
                    dev.copy_(host, non_blocking=True)
            stream.synchronize()
            times.append(time.perf_counter() - t0)
        rates.append(host.numel() / sorted(times)[1] / 1e9)
    return rates[0], rates[1]


def _pin_more(stop: threading.Event, extra: list, register_too: bool, touch_only: bool = False,
              most: int = 48, ready: list | None = None) -> None:
    """Pin 1 GiB mappings until ``stop`` (at most ``most`` GiB in all): fresh ones, zeroed or touched once per page,
    registered too if asked; or, given ``ready`` (mappings faulted in beforehand), only register those. Each
    entry of ``extra`` records when its registration ended (``time.perf_counter()``; None if not registered)."""
    cudart = torch.cuda.cudart()
    while not stop.is_set() and len(extra) < most:
        if ready is not None:
            try:
                m, t = ready.pop()
            except IndexError:
                return
        else:
            m, t = _mapping()
            _fault_in(t, touch_only)
        at = None
        if register_too:
            cudart.cudaHostRegister(t.data_ptr(), GIB, 0)
            at = time.perf_counter()
        extra.append((m, t, at))


def copy_while_pinning(threads: int, gib: int, dev: torch.device, stream: torch.cuda.Stream,
                       rounds: int = 4) -> dict:
    """D2H copies of ``gib`` GiB (``rounds`` times over, so that the copies last long enough for the workers to
    reach their registrations) into memory pinned beforehand: alone; while ``threads`` threads touch fresh mappings
    (host memory traffic); while they touch and register them (what the pool does); and while they only register
    mappings faulted in beforehand (the driver's part alone). Each as 1 GiB copies and as 25 MB ones (a tenant's
    storages), with the seconds it took to issue them and the GiB whose registration ended during the copies.
    Why: a tenant's first park copies into the pool's first chunks while the rest is pinned, and those copies ran
    at about 36 GB/s against 55 (bench/switch.py's first park at 20 GB, H100 and H200), while a copy with the pool
    already pinned ran at the floor."""
    src = torch.empty(GIB, dtype=torch.uint8, device=dev).random_()
    held = register(gib, threads, thp=True, parallel_register=True)
    out = {}
    # case -> whether the workers register (they touch one byte per page of fresh mappings, as the pool does)
    cases = {"alone": False, "while-touching": False, "while-touching-registering": True,
             "while-registering-only": True}
    piece = 25 * 10**6  # a tenant's storages: bench/switch.py's 800 tensors of 25 MB, one copy each
    cudart = torch.cuda.cudart()
    for case in cases:
        for size in (GIB, piece):
            register_too = cases[case]
            stop = threading.Event()
            extra: list = []
            ready = None
            if case == "while-registering-only":  # faulted in now, registered during the copies
                ready = [_mapping() for _ in range(32)]
                _parallel(lambda i, r=ready: _fault_in(r[i][1], True), len(ready), threads)
            workers = []
            if case != "alone":
                workers = [threading.Thread(target=_pin_more, args=(stop, extra, register_too, True),
                                            kwargs={"ready": ready}, daemon=True) for _ in range(threads)]
                for w in workers:
                    w.start()
                time.sleep(0.02)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                for _ in range(rounds):
                    for _m, host in held:
                        for at in range(0, GIB, size):
                            host[at:at + size].copy_(src[at:at + size], non_blocking=True)
            issue_s = time.perf_counter() - t0
            stream.synchronize()
            t1 = time.perf_counter()
            seconds = t1 - t0
            stop.set()
            for w in workers:
                w.join()
            registered_during = sum(1 for _m, _t, at in extra if at is not None and t0 <= at <= t1)
            for _m, t, at in extra:
                if at is not None:
                    cudart.cudaHostUnregister(t.data_ptr())
            name = case if size == GIB else f"{case}-25MB"
            moved = rounds * gib * GIB
            out[name] = {"seconds": seconds, "issue_s": issue_s, "copy_d2h_gbps": moved / seconds / 1e9,
                         "gib_pinned_meanwhile": len(extra), "gib_registered_during_copies": registered_during}
            print(f"copy while pinning ({name:>28}): {rounds}x{gib} GiB D2H in {seconds:.3f} s = "
                  f"{moved / seconds / 1e9:5.1f} GB/s (issued in {issue_s:.3f} s); {len(extra)} GiB pinned meanwhile, "
                  f"{registered_during} registered during the copies", flush=True)
            extra.clear()
            ready = None  # unmapped with the last reference
    unregister(held)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=int, default=8, help="GiB pinned by each method")
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--out", default="bench/results")
    ap.add_argument("--copy-while-pinning", action="store_true",
                    help="also time D2H copies into pinned memory while other threads pin more")
    ap.add_argument("--name", default="pin-rate-cuda.json", help="the JSON file's name under --out")
    ap.add_argument("--methods", default="", help="comma-separated subset of the methods (default: all)")
    ap.add_argument("--intra-op-threads", type=int, default=1,
                    help="torch.set_num_threads for the zeroing (1: each pinning thread zeroes alone)")
    args = ap.parse_args()
    if args.gib < 1 or args.threads < 1 or args.intra_op_threads < 1:
        ap.error("--gib, --threads and --intra-op-threads must be >= 1")
    torch.cuda.init()
    torch.set_num_threads(args.intra_op_threads)
    dev = torch.empty(GIB, dtype=torch.uint8, device="cuda").random_()
    stream = torch.cuda.Stream()
    result: dict = {"bench": "pin_rate", "host": platform.node(), "cpus": os.cpu_count(), "thp": _thp(),
                    "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gib": args.gib,
                    "threads": args.threads, "methods": {}}
    pageable = torch.empty(GIB, dtype=torch.uint8)
    pageable.zero_()
    result["pageable_copy_gbps"] = copy_rate(pageable, dev, stream)
    del pageable
    methods = {
        "hostalloc": lambda: hostalloc(args.gib, 1),
        "hostalloc-par": lambda: hostalloc(args.gib, args.threads),
        "register": lambda: register(args.gib, args.threads, thp=False, parallel_register=False),
        "register-thp": lambda: register(args.gib, args.threads, thp=True, parallel_register=False),
        "register-thp-par": lambda: register(args.gib, args.threads, thp=True, parallel_register=True),
        "register-thp-touch-par": lambda: register(args.gib, args.threads, thp=True, parallel_register=True,
                                                   touch_only=True),
        "register-touch-par": lambda: register(args.gib, args.threads, thp=False, parallel_register=True,
                                               touch_only=True),
    }
    wanted = [m for m in args.methods.split(",") if m] or list(methods)
    unknown = sorted(set(wanted) - set(methods))
    if unknown:
        ap.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(methods)}")
    result["intra_op_threads"] = args.intra_op_threads
    for name in wanted:
        fn = methods[name]
        t0 = time.perf_counter()
        held = fn()
        seconds = time.perf_counter() - t0
        first = held[0] if not isinstance(held[0], tuple) else held[0][1]
        d2h, h2d = copy_rate(first, dev, stream)
        result["methods"][name] = {"seconds": seconds, "pin_gbps": args.gib * GIB / seconds / 1e9,
                                   "copy_d2h_gbps": d2h, "copy_h2d_gbps": h2d}
        print(f"{name:>18}: {args.gib} GiB pinned in {seconds:6.2f} s = {args.gib * GIB / seconds / 1e9:6.2f} GB/s; "
              f"copies d2h {d2h:5.1f} GB/s, h2d {h2d:5.1f} GB/s", flush=True)
        if isinstance(held[0], tuple):
            unregister(held)
        del held, first
        if hasattr(torch._C, "_host_emptyCache"):  # torch caches freed pinned blocks: the next method starts bare
            torch._C._host_emptyCache()
    if args.copy_while_pinning:
        result["copy_while_pinning"] = copy_while_pinning(args.threads, args.gib, dev.device, stream)
    print(f"pageable copies: d2h {result['pageable_copy_gbps'][0]:.1f} GB/s, h2d {result['pageable_copy_gbps'][1]:.1f}"
          f" GB/s; THP {result['thp']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, os.path.basename(args.name))
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
