"""Full-parameter tenants of rota-service-tinker taking turns on one device: exact losses, switch time vs the floor.

Three (``--shapes``) full-parameter tenants, each a real ``tinker`` SDK client training its own
Qwen3-shaped model (Hugging Face snapshots in the hub-cache layout with random ``--dtype`` weights written by
``save_pretrained``, which the workers load with ``from_pretrained`` as users' models are; ``--config-only``
for snapshots the service random-inits),
run ``--steps`` forward_backward + optim_step steps each:

* *alone*: each tenant by itself on a fresh service (no switch); its losses are the reference;
* *together*: all tenants at once on one service with ``capacity_bytes=0`` (every switch parks
  the previous holder's weights, grads and Adam state and restores the next one's).

Reported (JSON, also on stdout): per tenant whether its losses together are **bit-identical** to
alone; per unit kind the service's timing breakdown; per switch the park and restore seconds and
bytes of each tenant; and the **pinned floor**: the bytes a switch moves divided by this device's
pinned host<->device copy bandwidth (measured here with one ``--floor-bytes`` buffer each way), so
``switch_vs_floor`` says how close a switch gets to what the copy engine allows. Workers run with
``deterministic=True`` (torch's deterministic algorithms) so CUDA results can be compared bit for bit.

    # H200 (about 6 minutes: three random inits of 0.6B/1.7B/4B twice, 4 steps each)
    python bench/tinker_full_turns.py --device cuda:0 --shapes qwen3-0.6b,qwen3-1.7b,qwen3-4b --steps 4 \\
        --out bench/results/tinker-full-turns-h200.json
    # CPU smoke run (tiny shapes)
    python bench/tinker_full_turns.py --device cpu --shapes qwen3-tiny,qwen3-tiny,qwen3-tiny --dtype float32 \\
        --steps 3 --seq-len 16 --batch 2
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import threading
import time

from tinker_density import _batch  # the same random next-token batches as the density bench

from rota_tinker.testing import QWEN3_SHAPES

log = logging.getLogger("tinker_full_turns")
T0 = time.perf_counter()


def _key(tenant: str) -> str:
    """A tenant's API key: 128 random-looking bits and more (the service refuses guessable keys)."""
    return "tml-" + hashlib.sha256(f"rota-bench-full:{tenant}".encode()).hexdigest()[:43]


def say(msg: str) -> None:
    """Progress on stderr (a run takes minutes): seconds since the start, then the message."""
    sys.stderr.write(f"[{time.perf_counter() - T0:7.1f}s] {msg}\n")
    sys.stderr.flush()


def run(specs: dict, tenants: list[tuple[str, str]], args: argparse.Namespace) -> tuple[dict, list[dict]]:
    """Each (tenant, base) trains ``args.steps`` steps, all at once, on one service; losses per tenant, unit timings."""
    import tinker
    from tinker import types

    from rota_tinker import ServiceConfig, Tenant, TinkerService
    from rota_tinker.testing import full_training_client

    cfg = ServiceConfig(tenants=tuple(Tenant(t, _key(t)) for t, _ in tenants),
                        data_dir=tempfile.mkdtemp(prefix="tinker-full-"), device=args.device, long_poll_s=5.0,
                        base_models=specs, capacity_bytes=0, deterministic=True, max_bytes=2**50,
                        worker_start_timeout_s=600.0, stop_timeout_s=60.0)
    losses: dict[str, list[float]] = {}
    errors: list[BaseException] = []
    with TinkerService(cfg) as svc:
        clients = {t: tinker.ServiceClient(base_url=svc.url, api_key=_key(t)) for t, _ in tenants}

        def train(tenant: str, base: str) -> None:
            try:
                tc = full_training_client(clients[tenant], base, timeout_s=1200)
                data = _batch(specs[base].vocab, args.seq_len, args.batch, seed=int(tenant[1:]))
                out = []
                say(f"{tenant} ({base}) created its model")
                for step in range(args.steps):
                    fb = tc.forward_backward(data, "cross_entropy")
                    op = tc.optim_step(types.AdamParams(learning_rate=1e-5))
                    out.append(fb.result(timeout=1200).metrics["loss:sum"])
                    op.result(timeout=1200)
                    say(f"{tenant} step {step + 1}/{args.steps}: loss {out[-1]:.4f}")
                losses[tenant] = out
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=train, args=tb) for tb in tenants]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        units = svc.unit_timings()
        for c in clients.values():
            c.close("success").result(30)
    if errors:
        raise errors[0]
    return losses, units


def pinned_floor(device: str, nbytes: int) -> dict:
    """Pinned host->device and device->host copy bandwidth (bytes/s) of one ``nbytes`` buffer; None on CPU."""
    import torch

    if not device.startswith("cuda"):
        return {"h2d_bytes_per_s": None, "d2h_bytes_per_s": None}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(3):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        out[f"{name}_bytes_per_s"] = 3 * nbytes / (time.perf_counter() - t0)
    return out


def switches(units: list[dict], floor: dict) -> dict:
    """Per tenant: medians of parks (seconds, bytes) and restores of its units, and both against the floor."""
    out: dict = {}
    for tenant in sorted({u["tenant"] for u in units}):
        mine = [u for u in units if u["tenant"] == tenant and not u["failed"]]
        parks = [(u["parked_s"], u["parked_bytes"]) for u in mine if u.get("parked_bytes")]
        restores = [u["restore_s"] for u in mine if u.get("restore_s")]
        row: dict = {"parks": len(parks), "restores": len(restores)}
        if parks:
            row["median_park_s"] = statistics.median(p[0] for p in parks)
            row["park_bytes"] = max(p[1] for p in parks)
        if restores:
            row["median_restore_s"] = statistics.median(restores)
        if parks and floor["h2d_bytes_per_s"]:
            row["floor_park_s"] = row["park_bytes"] / floor["d2h_bytes_per_s"]
            row["park_vs_floor"] = row["median_park_s"] / row["floor_park_s"]
            if restores:
                row["floor_restore_s"] = row["park_bytes"] / floor["h2d_bytes_per_s"]
                row["restore_vs_floor"] = row["median_restore_s"] / row["floor_restore_s"]
        out[tenant] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--shapes", default="qwen3-0.6b,qwen3-1.7b,qwen3-4b", help="one Qwen3 shape per tenant")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--floor-bytes", type=int, default=2**30, help="buffer size of the pinned-copy measurement")
    p.add_argument("--config-only", action="store_true",
                   help="snapshots with a config alone (the service random-inits them on the device) instead of "
                        "random weights written with save_pretrained and loaded with from_pretrained, as users do")
    p.add_argument("--out", default="")
    args = p.parse_args()
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    bad = [s for s in shapes if s not in QWEN3_SHAPES]
    if bad or not shapes or args.steps < 1:
        p.error(f"--shapes {bad or shapes} must name shapes of {sorted(QWEN3_SHAPES)}; --steps >= 1")
    logging.basicConfig(level=os.environ.get("ROTA_LOG_LEVEL", "WARNING"))
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    from rota_tinker.testing import qwen3_shaped

    t0 = time.perf_counter()
    cache = tempfile.mkdtemp(prefix="tinker-bench-hub-")
    specs = {}
    for shape in sorted(set(shapes)):
        say(f"writing the {shape} snapshot ({'config only' if args.config_only else 'save_pretrained'})")
        spec = qwen3_shaped(cache, shape, args.dtype, weights=not args.config_only)
        specs[spec.name] = spec
    tenants = [(f"t{i}", f"bench/{shape}") for i, shape in enumerate(shapes)]
    alone = {}
    for t, b in tenants:
        say(f"{t} alone on {b}")
        alone[t] = run(specs, [(t, b)], args)[0][t]
    say(f"all {len(tenants)} together")
    together, units = run(specs, tenants, args)
    say("done; measuring the pinned copy floor")
    floor = pinned_floor(args.device, args.floor_bytes)
    result = {"bench": "tinker_full_turns", "device": args.device, "host": platform.node(), "args": vars(args),
              "tenants": {t: {"base_model": b, "params": specs[b].params(), "losses_alone": alone[t],
                              "losses_together": together[t], "bit_identical": alone[t] == together[t]}
                          for t, b in tenants},
              "all_bit_identical": all(alone[t] == together[t] for t, _ in tenants),
              "pinned_floor": floor, "switches": switches(units, floor), "wall_s": time.perf_counter() - t0}
    text = json.dumps(result, indent=2)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
