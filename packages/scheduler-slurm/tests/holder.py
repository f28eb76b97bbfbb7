"""A tenant that takes its turn and never gives it back (for the clean-up tests).

``python holder.py rota MARKER`` holds through ``rota.connect()`` (a rota.v1 session);
``python holder.py v1alpha1 MARKER [--exit]`` holds through the plain v1alpha1 Acquire
(with the job's ROTA_TOKEN), which has no session, so only the Slurm epilog's Evict can
free the group. MARKER is
written once the turn is held; with ``--exit`` the job ends while still holding.
"""

from __future__ import annotations

import os
import sys
import time


def main() -> None:
    kind, marker = sys.argv[1], sys.argv[2]
    if kind == "rota":
        import rota

        gpu = rota.connect()
        gpu.acquire()
    else:
        from rota import auth
        from rota.wire import timeslice_orchestrator_pb2 as v1a
        from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc

        with auth.channel(os.environ["ROTA_ORCHESTRATOR"]) as ch:
            stub = v1a_grpc.TimeSliceOrchestratorServiceStub(ch)
            stub.Acquire(v1a.AcquireRequest(job_id=os.environ["ROTA_TENANT"], group_id=os.environ["ROTA_GROUP"]),
                         timeout=60)
    with open(marker, "w") as f:
        f.write("holding\n")
    if "--exit" in sys.argv:
        os._exit(0)  # leave without releasing
    time.sleep(600)


if __name__ == "__main__":
    main()
