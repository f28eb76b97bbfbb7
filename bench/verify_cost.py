"""Switch guarantees on a real device: residue after park, and what ``--verify`` costs.

For each size, a model-like set of tensors (``--tensors`` big matrices and small
vectors) is tracked by a :class:`rota_torch.TensorParker` and parked + restored
``--repeats`` times with ``verify`` = off, sample and full. Reported per mode: median
park and restore seconds, and the verification cost as a fraction of the switch time
(park + restore) of ``off``. Every restore is checked against a saved checksum.

Residue: a ``rota_fsdp``-tracked model with Adam (after one step) is parked through
``gpu.park()`` against an in-process orchestrator; reported are the residue entries
of the park result (tracked tags, ``untracked:...``, allocator totals) and the device
memory ``mem_get_info`` says is used before/after, next to the CUDA context's own.

    python bench/verify_cost.py --device cuda --sizes 4GB,16GB --out bench/results/verify-cuda.json
    python bench/verify_cost.py --device cpu --sizes 64MB
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import statistics
import time

import torch

from rota_torch import HostPool, TensorParker

log = logging.getLogger("verify_cost")
UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}


def parse_size(text: str) -> int:
    t = text.strip().upper()
    for unit in ("KB", "MB", "GB", "B"):
        if t.endswith(unit):
            return int(float(t[: -len(unit)]) * UNITS[unit])
    return int(t)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_tensors(nbytes: int, count: int, device: torch.device) -> list[torch.Tensor]:
    """Roughly ``nbytes`` of bf16 in ``count`` tensors: 90% of the bytes in a quarter of them."""
    big = max(1, count // 4)
    per_big = int(nbytes * 0.9) // big // 2
    per_small = max(1, int(nbytes * 0.1) // max(1, count - big) // 2)
    out = [torch.randn(per_big, device=device, dtype=torch.bfloat16) for _ in range(big)]
    out += [torch.randn(per_small, device=device, dtype=torch.bfloat16) for _ in range(count - big)]
    return out


def checksum(ts: list[torch.Tensor]) -> int:
    return int(sum(int(t.view(torch.int16).to(torch.int64).sum()) for t in ts))


def cost(device: torch.device, nbytes: int, count: int, repeats: int) -> dict:
    ts = make_tensors(nbytes, count, device)
    want = checksum(ts)
    pool = HostPool(pin=device.type == "cuda")
    pool.reserve(sum(t.untyped_storage().nbytes() + 512 for t in ts))
    out: dict = {"bytes": sum(t.nbytes for t in ts), "tensors": len(ts)}
    for mode in ("off", "sample", "full"):
        parker = TensorParker(device, pool=pool, verify=mode, release_cached=False, name=mode)
        parker.add("weights", ts)
        parks, restores, verify_s = [], [], []
        for _ in range(repeats):
            sync(device)
            p = parker.park()
            r = parker.restore()
            parks.append(p.seconds)
            restores.append(r.seconds)
            verify_s.append(p.verify_seconds + r.verify_seconds)
        assert checksum(ts) == want, f"verify={mode}: restored bytes differ"
        out[mode] = {"park_s": statistics.median(parks), "restore_s": statistics.median(restores),
                     "verify_s": statistics.median(verify_s)}
    base = out["off"]["park_s"] + out["off"]["restore_s"]
    for mode in ("sample", "full"):
        m = out[mode]
        m["switch_s"] = m["park_s"] + m["restore_s"]
        m["extra_fraction_of_switch"] = (m["switch_s"] - base) / base
        m["verify_fraction_of_switch"] = m["verify_s"] / base
    log.info("%.1f GB: off %.3f s, sample +%.2f%%, full +%.2f%%", out["bytes"] / 1e9, base,
             100 * out["sample"]["extra_fraction_of_switch"], 100 * out["full"]["extra_fraction_of_switch"])
    del ts
    return out


def residue(device: torch.device, nbytes: int) -> dict:
    import rota
    import rota_fsdp
    from rota.orchestrator import OrchestratorConfig
    from rota.testing import running_orchestrator

    width = max(256, int((nbytes / 2 / 4) ** 0.5))
    with running_orchestrator(OrchestratorConfig()) as (endpoint, _):
        gpu = rota.connect(group="g", tenant="bench", endpoint=endpoint)
        model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width))
        model = model.to(device)
        opt = torch.optim.Adam(model.parameters())
        tracked = rota_fsdp.track(gpu, model, opt)
        tracked.prepare()
        with gpu.turn():
            x = torch.randn(64, width, device=device)
            model(x).square().mean().backward()
            opt.step()
            del x
        sync(device)
        used = lambda: (lambda f: int(f[1] - f[0]))(torch.cuda.mem_get_info(device)) if device.type == "cuda" else 0  # noqa: E731
        before = {"allocated": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
                  "device_used": used()}
        gpu.park()
        res = dict(gpu.last_park.residue)
        after = {"allocated": torch.cuda.memory_allocated(device) if device.type == "cuda" else 0,
                 "device_used": used()}
        with gpu.turn():
            pass
        tracked.untrack()
        gpu.close()
    return {"model_bytes": sum(tracked.footprint().values()), "before_park": before, "after_park": after,
            "park_residue": res}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--sizes", default="4GB,16GB")
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--residue-bytes", default="2GB")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="[verify_cost %(asctime)s] %(message)s")
    if args.tensors < 4 or args.repeats < 1:
        ap.error(f"--tensors {args.tensors} must be >= 4 and --repeats {args.repeats} >= 1")
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    t0 = time.time()
    result = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
              "torch": torch.__version__, "repeats": args.repeats,
              "residue_fsdp": residue(device, parse_size(args.residue_bytes)),
              "verify": {s: cost(device, parse_size(s), args.tensors, args.repeats) for s in args.sizes.split(",")}}
    result["seconds"] = time.time() - t0
    text = json.dumps(result, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    log.info("%s", text)


if __name__ == "__main__":
    main()
