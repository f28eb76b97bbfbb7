"""A tenant process for rota_etcd's tests: acquire -> work -> release in a loop.

Every turn is logged to --log as three lines, written and flushed before the tenant
uses or gives back the group, so a checker can line up turns of many processes:

    ask   JOB GROUP ASKED_AT
    grant JOB GROUP TOKEN GRANTED_AT ASKED_AT
    end   JOB GROUP TOKEN ENDED_AT

(wall-clock seconds). With --hold it acquires once and keeps the turn until killed.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import rota
from rota.errors import RotaError


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--job", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--turns", type=int, default=0, help="0 = until killed")
    ap.add_argument("--work-ms", type=float, nargs=2, default=(5.0, 30.0))
    ap.add_argument("--gap-ms", type=float, nargs=2, default=(0.0, 20.0))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hold", action="store_true")
    ns = ap.parse_args()
    rng = random.Random(ns.seed)
    gpu = rota.connect(group=ns.group, tenant=ns.job, endpoint=ns.endpoint)
    with open(ns.log, "a", buffering=1) as log:
        n = 0
        while ns.turns == 0 or n < ns.turns:
            asked = time.time()
            log.write(f"ask {ns.job} {ns.group} {asked:.6f}\n")
            try:
                grant = gpu.acquire()
            except RotaError as exc:  # retried for a minute by the client already
                log.write(f"error {ns.job} {ns.group} acquire {type(exc).__name__}\n")
                continue
            log.write(f"grant {ns.job} {ns.group} {grant.token} {time.time():.6f} {asked:.6f}\n")
            if ns.hold:
                print("holding", flush=True)
                time.sleep(3600)
            time.sleep(rng.uniform(*ns.work_ms) / 1000)
            log.write(f"end {ns.job} {ns.group} {grant.token} {time.time():.6f}\n")
            try:
                gpu.release()
            except RotaError as exc:
                log.write(f"error {ns.job} {ns.group} release {type(exc).__name__}\n")
            n += 1
            time.sleep(rng.uniform(*ns.gap_ms) / 1000)
    gpu.close()


if __name__ == "__main__":
    sys.exit(main())
