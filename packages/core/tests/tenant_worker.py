"""A tenant process for the tests: acquire, log the grant, hold, release, repeat.

Usage: tenant_worker.py ENDPOINT GROUP JOB TURNS HOLD_S [--ready-file F]
Prints one line per event: ``<event> <job> <token> <monotonic>`` (event = granted|released).
"""

import sys
import time

import rota


def main() -> None:
    endpoint, group, job, turns, hold = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), float(sys.argv[5])
    gpu = rota.connect(group=group, tenant=job, endpoint=endpoint)
    for _ in range(turns):
        grant = gpu.acquire()
        print(f"granted {job} {grant.token} {time.monotonic():.6f}", flush=True)
        time.sleep(hold)
        print(f"released {job} {grant.token} {time.monotonic():.6f}", flush=True)
        gpu.release()
    gpu.close()


if __name__ == "__main__":
    main()
