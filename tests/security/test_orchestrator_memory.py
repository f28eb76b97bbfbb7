"""Issue 45 row 7: a tenant's memory report is its own word, so a lie in it costs its neighbours nothing.

The orchestrator checks tokens (``ServerAuth(key=...)``); the attacker holds a valid token for its own job of
group g and keeps a live session (a raw ``Attach`` stream) whose one heartbeat says its last park left 2^50 bytes
on the device. Two real tenants of 4 GiB each take turns under a 10 GiB capacity: together they fit, so none of
them is ever parked. With the report counted whole, every switch parked the other one.
"""

from __future__ import annotations

import os
import threading

import grpc

import rota
from rota import auth
from rota.orchestrator import OrchestratorConfig
from rota.residue import DEFAULT_RESIDUE_MAX_BYTES
from rota.testing import ListState, eventually, running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc

KEY = b"k" * 32
GIB = 1 << 30


def _lying_session(endpoint: str, stop: threading.Event) -> threading.Thread:
    """Mallory's session: hello, one heartbeat reporting 2^50 bytes left on the device (and as its footprint),
    then heartbeats that say nothing changed, until ``stop``."""
    def messages():
        yield pb.TenantMessage(hello=pb.Hello(job_id="mallory", group_id="g", rank=0, world_size=1, pid=os.getpid()))
        yield pb.TenantMessage(heartbeat=pb.Heartbeat(footprint_bytes=1 << 50, host_bytes=1 << 50,
                                                      residue_bytes=1 << 50))
        while not stop.wait(0.5):
            yield pb.TenantMessage(heartbeat=pb.Heartbeat(footprint_bytes=1 << 50, memory_unchanged=True))

    def run() -> None:
        call = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="g", job="mallory")))
        try:
            for _ in call.Attach(messages(), timeout=60):
                pass
        except grpc.RpcError:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_lie_about_residue_parks_no_neighbour():
    config = OrchestratorConfig(ttl_s=10.0, capacity_bytes=10 * GIB)
    with running_orchestrator(config, auth=auth.ServerAuth(key=KEY)) as (endpoint, engine):
        stop = threading.Event()
        liar = _lying_session(endpoint, stop)
        tenants = [rota.connect(group="g", tenant=t, endpoint=endpoint, token=auth.issue(KEY, group="g", job=t))
                   for t in ("a", "b")]
        states = [ListState(gpu, nbytes=4 * GIB) for gpu in tenants]
        try:
            rec = eventually(lambda: "g" in engine.groups and engine.groups["g"].tenants.get("mallory"),
                             "mallory's session")
            eventually(lambda: rec.residue_bytes, "mallory's report recorded")
            for _ in range(3):
                for gpu in tenants:
                    with gpu.turn():
                        pass
            assert [s.calls.count("park") for s in states] == [0, 0], [s.calls for s in states]  # was [3, 2]
            assert rec.residue_bytes == DEFAULT_RESIDUE_MAX_BYTES  # capped at --residue-allowance, not 2^50
            g = engine.groups["g"]
            assert sorted(g.residents) == ["a", "b"] and g.tenants["mallory"].state != "lost"
        finally:
            stop.set()
            for gpu, state in zip(tenants, states, strict=True):
                state.close()
                gpu.close()
            liar.join(10)
