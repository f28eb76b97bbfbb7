"""One rank of a 2-rank job for test_job_as_unit.py (no torch: the 'collective' is a wait).

Usage: rank_worker.py ENDPOINT GROUP JOB RANK WORLD MODE
MODE:
  wait     acquire, print "granted", then wait for the other rank as a collective
           would, until the orchestrator aborts the job
  raise    acquire, then raise inside the turn
  restore  one turn; after "go" on stdin a second turn, whose restore fails on rank 1
Every rank prints "aborted <reason>" when the rota_job_aborted hook runs, and a rank
that was aborted tries one more acquire and prints "refused <ErrorType>".
"""

import sys
import threading
import time

import rota
from rota import ParkResult, hookimpl
from rota.errors import RotaError

_say = threading.Lock()


def say(line: str) -> None:
    """One whole line on stdout: the abort hook's thread and the main thread both print, and print() writes the
    text and its newline separately (two lines once came out glued: 'aborted ...refused Faulted')."""
    with _say:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


class FakeState:
    """Stands in for a tracked model: 1 byte of footprint, parks fine, restore fails on rank 1 if asked."""

    def __init__(self, gpu: rota.Gpu, fail_restore: bool) -> None:
        self.gpu, self.fail_restore = gpu, fail_restore

    @hookimpl
    def rota_footprint(self, tenant):
        return {"weights": 1} if tenant is self.gpu else None

    @hookimpl
    def rota_park(self, tenant, plan):
        return ParkResult(bytes_moved=1) if tenant is self.gpu else None

    @hookimpl
    def rota_restore(self, tenant, plan):
        if tenant is not self.gpu:
            return None
        if self.fail_restore:
            raise RuntimeError("host copy unreadable (test)")
        return ParkResult(bytes_moved=1)

    @hookimpl
    def rota_job_aborted(self, tenant, reason):
        if tenant is self.gpu:
            say(f"aborted {reason}")


def wait_for_peer(gpu: rota.Gpu) -> None:
    """What a collective does when the other rank never comes: wait (here: until aborted)."""
    deadline = time.monotonic() + 120
    while not gpu.aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        gpu.acquire()
        say("acquired again")
    except RotaError as exc:
        say(f"refused {type(exc).__name__}")


def main() -> None:
    endpoint, group, job, rank, world, mode = sys.argv[1:7]
    gpu = rota.Gpu(group, job, endpoint, rank=int(rank), world_size=int(world))
    gpu.pm.register(FakeState(gpu, fail_restore=mode == "restore" and rank == "1"))
    if mode == "restore":
        with gpu.turn():
            pass
        say("released")
        sys.stdin.readline()
    try:
        with gpu.turn():
            say("granted")
            if mode == "raise" and rank == "1":
                raise ValueError("loss is NaN (test)")
            wait_for_peer(gpu)
    except ValueError:
        say("raised")
    except Exception as exc:  # rank 1's failed restore (the job is faulted; nothing more to do here)
        say(f"failed {type(exc).__name__}")

if __name__ == "__main__":
    main()
