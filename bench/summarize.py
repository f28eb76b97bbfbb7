"""Print the README's "How fast is a switch" table from the JSON in bench/results/.

    python bench/summarize.py            # markdown on stdout
"""

from __future__ import annotations

import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def main() -> None:
    print("| path (H200, bf16, 800 tensors) | size | park | restore | overlapped park ‖ restore | source |")
    print("|---|---|---|---|---|---|")
    for name, label in (("switch-cuda.json", "adapter, memory returned to driver (default)"),
                        ("switch-cuda-keepcache.json", "adapter, memory kept in torch's cache")):
        d = _load(name)
        for r in (d or {}).get("results", []):
            print(f"| {label} | {r['size_bytes'] / 1e9:.0f} GB | {r['park_s']:.3f} s = {r['park_ratio']:.2f}x floor "
                  f"| {r['restore_s']:.3f} s = {r['restore_ratio']:.2f}x floor | {r['overlap_gbps']:.0f} GB/s "
                  f"(bare copy {r['floor_overlap_gbps']:.0f}) | {name} |")
    for name in ("agent-cuda-4GB.json", "agent-cuda-40GB.json"):
        d = _load(name)
        if not d:
            continue
        for w in d.get("whole_process_cuda", []):
            print(f"| agent, whole-process (CUDA checkpoint) | {w['size_bytes'] / 1e9:.0f} GB | {w['park_s']:.2f} s "
                  f"({w['park_GBps']:.1f} GB/s) | {w['restore_s']:.2f} s ({w['restore_GBps']:.1f} GB/s) | - | {name} |")
        for r in d.get("region_app_channel", []):
            best = min(r["switches"])
            print(f"| agent, region app_channel, release→grant end to end | {r['size_bytes'] / 1e9:.0f} GB | - | - | "
                  f"best {best:.2f} s = {best / r['floor_switch_s']:.2f}x overlapped floor "
                  f"(median {r['ratio_vs_floor']:.2f}x) | {name} |")
    demo = _load("demo-cuda-4GB.json")
    if demo:
        ts = demo["timesliced"]
        print(f"\n`rota demo --device cuda --state 4GB --groups 1` on one H200: time-sliced makespan ÷ serial = "
              f"{demo['ratios']['timesliced_over_serial_makespan']:.2f}, busy {ts['busy_fraction']:.0%}, "
              f"{ts['switches']} switches, park p50 {ts['park_ms_p50']:.0f} ms / restore p50 "
              f"{ts['restore_ms_p50']:.0f} ms, {ts['bytes_moved'] / 2**30:.0f} GiB moved, bit-identical: "
              f"{all(t['bit_identical'] for t in demo['tenants'])} (demo-cuda-4GB.json).")
    for name, label in (("handoff-cpu.json", "embedded"), ("handoff-etcd-cpu.json", "through etcd")):
        d = _load(name)
        if d:
            print(f"Handoff with state resident, {label} (2-core CPU): p50 {d['p50_ms']:.2f} ms, "
                  f"p99 {d['p99_ms']:.2f} ms ({name}).")


if __name__ == "__main__":
    main()
