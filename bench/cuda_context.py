"""Where the seconds of a worker's first CUDA call go on this host, step by step, in fresh processes.

Why: on the H100 hosts every worker of ``rota demo`` and of the Tinker service spends 5-7 s making its CUDA
context (persistence mode on), about a fifth of the CUDA tier's time: 4 starts per demo run, 6 workers each.
This times, in a fresh process per case (``--repeats`` of each):

* ``driver``: ``cuInit`` and ``cuDevicePrimaryCtxRetain`` through ctypes (libcuda only: what the driver costs);
* ``torch``: ``import torch``, ``torch.cuda.init()``, ``set_device``, the first kernel and ``synchronize``,
  ``torch.use_deterministic_algorithms`` (it imports ``torch._inductor.config``: the 3.5-4 s that this bench's runs
  up to 9ce0a14 counted in "first matmul", and what made the demo's set-up slow) and cuBLAS's first matmul (what
  the demo's toy worker does);
* ``torch-eager``: the same with ``CUDA_MODULE_LOADING=EAGER`` (every kernel of torch loaded at once);
* ``forked``: the ``torch`` steps in a child forked from a parent that imported torch without CUDA (how the demo's
  forkserver starts workers);
* ``concurrent``: ``--workers`` of the ``torch`` case started at once (a demo start makes six contexts at once);
* ``forkserver-demo``: ``--workers`` children of a ``forkserver`` that preloaded what ``rota demo``'s preloads
  (``rota_demo.runner.forkserver_preload``), started at once, as a demo start makes its toy workers. Why: in the
  demo's JSON each toy worker's "CUDA context" phase (set_device and a synchronize) took 5-7 s on an H100, where
  the ``forked`` case's context took 0.3 s.
* ``torch-beside`` and ``forkserver-demo-beside`` (``--beside``): the ``torch`` case and the ``forkserver-demo``
  children again while another process holds a CUDA context of its own, idle, as the CUDA tier's pytest process
  does while a demo it started makes its workers' contexts (the demo's set_device took 6.6-7.5 s there on an H100
  at 31cc2cc, against 0.54-0.60 s in this bench's ``forkserver-demo`` with no other process on the device).
  Found on an H100 at 9ce0a14 (``bench/results/cuda-context-h100-9ce0a14.json``): another context changes nothing
  (set_device 0.58-0.62 s beside one, 0.52-0.54 s alone); py-spy put the demo's seconds in
  ``torch.use_deterministic_algorithms``, just before set_device, which the forkserver now preloads.

    python bench/cuda_context.py --out bench/results/cuda-context.json
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

STEPS = r"""
import json, os, sys, time
t0 = time.monotonic()
marks = {}
import torch
marks["import torch"] = time.monotonic()
torch.cuda.init()
marks["torch.cuda.init"] = time.monotonic()
torch.cuda.set_device(0)
marks["set_device"] = time.monotonic()
x = torch.zeros(1, device="cuda")
torch.cuda.synchronize()
marks["first kernel + sync"] = time.monotonic()
torch.use_deterministic_algorithms(True)
marks["use_deterministic_algorithms"] = time.monotonic()
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
a = torch.randn(256, 256, device="cuda")
(a @ a).sum().item()
marks["first matmul"] = time.monotonic()
last, out = t0, {}
for k, v in marks.items():
    out[k] = round(v - last, 4)
    last = v
out["total"] = round(last - t0, 4)
print(json.dumps(out))
"""


def _driver() -> dict[str, float]:
    """cuInit and the primary context through libcuda alone, in this (fresh) process."""
    cuda = ctypes.CDLL("libcuda.so.1")
    t0 = time.monotonic()
    assert cuda.cuInit(0) == 0
    t1 = time.monotonic()
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    assert cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    t2 = time.monotonic()
    assert cuda.cuCtxSetCurrent(ctx) == 0
    free, total = ctypes.c_size_t(), ctypes.c_size_t()
    assert cuda.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)) == 0
    t3 = time.monotonic()
    return {"cuInit": round(t1 - t0, 4), "primary context": round(t2 - t1, 4), "first call": round(t3 - t2, 4),
            "total": round(t3 - t0, 4)}


def _run(code: str, env: dict[str, str] | None = None) -> dict[str, float]:
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **(env or {})})
    if r.returncode != 0:
        raise SystemExit(f"a probe process failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


FORKED = r"""
import json, os, sys, time
import torch  # the parent imports torch without CUDA, as the demo's forkserver does
r, w = os.pipe()
if os.fork() == 0:
    os.close(r)
    import io, contextlib, traceback
    buf, code = io.StringIO(), 0
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(STEPS, "steps", "exec"))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os.write(w, buf.getvalue().encode())
        os._exit(code)
os.close(w)
data = b""
while chunk := os.read(r, 65536):
    data += chunk
_, status = os.wait()
if status or not data.strip():
    sys.exit(f"the forked child failed (wait status {status})")
print(data.decode().strip().splitlines()[-1])
"""


@contextlib.contextmanager
def _context_holder() -> Iterator[None]:
    """Another process holding a CUDA context (a tensor on the device), idle until the block ends."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, torch; x = torch.zeros(1, device='cuda'); "
                               "torch.cuda.synchronize(); print('ready', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "ready":
            raise SystemExit(f"the context holder did not start (exit {holder.wait(timeout=60)})")
        yield
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def _steps_in_child(queue: Any, steps: str) -> None:
    """A forkserver child: the steps, their JSON line put on ``queue`` (a failure's traceback instead)."""
    import contextlib
    import io
    import traceback

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(steps, "steps", "exec"), {})
        queue.put(json.loads(buf.getvalue().strip().splitlines()[-1]))
    except BaseException:
        queue.put({"error": traceback.format_exc()[-2000:]})


def forkserver_case(workers: int, steps: str = STEPS) -> tuple[list[dict], float]:
    """``workers`` children of a forkserver with the demo's preload, started at once: each one's marks, and the
    wall seconds until all had reported (the forkserver's own start and its preload's imports included, as at a
    demo run's first start). Once per process: a forkserver already running keeps the preload it started with."""
    import multiprocessing as mp

    from rota_demo.runner import forkserver_preload

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(forkserver_preload(llm=False))
    results = ctx.Queue()
    procs = [ctx.Process(target=_steps_in_child, args=(results, steps)) for _ in range(workers)]
    t0 = time.monotonic()
    for pr in procs:
        pr.start()
    runs: list[dict] = []
    while len(runs) < len(procs):  # a child that died before reporting is not waited for
        try:
            runs.append(results.get(timeout=1))
        except queue.Empty:
            if not any(pr.is_alive() for pr in procs) and results.empty():
                raise SystemExit(f"{len(procs) - len(runs)} forkserver children exited without reporting (exit "
                                 f"codes {[pr.exitcode for pr in procs]})") from None
            if time.monotonic() - t0 > 300:
                raise SystemExit("the forkserver children did not report within 300 s") from None
    wall = time.monotonic() - t0
    for pr in procs:
        pr.join(30)
    failed = [r["error"] for r in runs if "error" in r]
    if failed:
        raise SystemExit(f"a forkserver child failed:\n{failed[0]}")
    return runs, round(wall, 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per case")
    p.add_argument("--workers", type=int, default=6, help="processes started at once in the concurrent case")
    p.add_argument("--out", default="", help="write the JSON here too")
    p.add_argument("--beside", action="store_true",
                   help="also the torch and forkserver-demo cases beside another process's idle CUDA context")
    a = p.parse_args()
    if a.repeats < 1 or a.workers < 1:
        raise SystemExit(f"--repeats {a.repeats} / --workers {a.workers}: both must be at least 1")
    driver_code = "import json, sys; sys.path.insert(0, %r); import cuda_context as c; print(json.dumps(c._driver()))"
    here = os.path.dirname(os.path.abspath(__file__))
    cases: dict[str, list] = {"driver": [], "torch": [], "torch-eager": [], "forked": []}
    for _ in range(a.repeats):
        cases["driver"].append(_run(driver_code % here))
        cases["torch"].append(_run(STEPS))
        cases["torch-eager"].append(_run(STEPS, {"CUDA_MODULE_LOADING": "EAGER"}))
        cases["forked"].append(_run(f"STEPS = {STEPS!r}\n" + FORKED))
    t0 = time.monotonic()
    procs = [subprocess.Popen([sys.executable, "-c", STEPS], stdout=subprocess.PIPE, text=True)
             for _ in range(a.workers)]
    cases["concurrent"] = [json.loads(pr.communicate(timeout=300)[0].strip().splitlines()[-1]) for pr in procs]
    wall = time.monotonic() - t0
    cases["forkserver-demo"], forkserver_wall = forkserver_case(a.workers)
    if a.beside:
        with _context_holder():
            cases["torch-beside"] = [_run(STEPS) for _ in range(a.repeats)]
            cases["forkserver-demo-beside"], _ = forkserver_case(a.workers)
    out = {"bench": "cuda_context", "host": platform.node(), "python": sys.version.split()[0],
           "persistence_mode": subprocess.run(["nvidia-smi", "--query-gpu=name,persistence_mode,driver_version",
                                               "--format=csv,noheader"], capture_output=True, text=True).stdout.strip(),
           "cases": cases, "concurrent_wall_s": round(wall, 3), "forkserver_wall_s": forkserver_wall,
           "workers": a.workers}
    text = json.dumps(out, indent=2)
    print(text)
    for name, runs in cases.items():
        totals = ", ".join(f"{r['total']:.2f}" for r in runs)
        print(f"{name:12s} total s: {totals}", file=sys.stderr)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
