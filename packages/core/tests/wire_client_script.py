"""A v1alpha1 client that imports only stubs compiled from the v1alpha1 protos — no rota.

Run by test_wire_client.py in its own interpreter (the stubs' descriptors would clash
with rota's in one process), with the stubs' folder on PYTHONPATH. Usage: wire_client_script.py ENDPOINT
Exits 0 and prints OK when every expectation held.
"""

import sys
import threading
import time

import grpc
import timeslice_orchestrator_pb2 as pb2
import timeslice_orchestrator_pb2_grpc as grpc_mod

assert "rota" not in sys.modules


def main(endpoint: str) -> None:
    with grpc.insecure_channel(endpoint) as ch:
        stub = grpc_mod.TimeSliceOrchestratorServiceStub(ch)
        r = stub.Acquire(pb2.AcquireRequest(job_id="trainer", group_id="g0"), timeout=10)
        assert r.success and r.waited_ms >= 0
        assert stub.Acquire(pb2.AcquireRequest(job_id="trainer", group_id="g0"), timeout=10).success
        st = stub.GetGroupStatus(pb2.GetGroupStatusRequest(group_id="g0"), timeout=10).group
        assert st.locking_job == "trainer" and st.group_state == pb2.GroupStatus.STATE_LOCKED, st
        assert list(stub.ListGroups(pb2.ListGroupsRequest(), timeout=10).group_ids) == ["g0"]

        got = {}
        t = threading.Thread(target=lambda: got.update(
            r=stub.Acquire(pb2.AcquireRequest(job_id="sampler", group_id="g0"), timeout=30)))
        t.start()
        deadline = time.monotonic() + 20
        while stub.GetGroupStatus(pb2.GetGroupStatusRequest(group_id="g0")).group.waiter_queue_depth != 1:
            assert time.monotonic() < deadline, "sampler never queued"
            time.sleep(0.01)
        time.sleep(0.05)  # the sampler has waited at least this long when it is granted
        y = stub.Yield(pb2.YieldRequest(job_id="trainer", group_id="g0"), timeout=10)
        assert y.success and y.pending_waiters == 1 and not y.snapshot_deferred, y
        t.join(30)
        assert got["r"].success and got["r"].waited_ms >= 50, got
        y2 = stub.Yield(pb2.YieldRequest(job_id="sampler", group_id="g0"), timeout=10)
        assert y2.snapshot_deferred and y2.pending_waiters == 0, y2
        st = stub.GetGroupStatus(pb2.GetGroupStatusRequest(group_id="g0"), timeout=10).group
        assert st.group_state == pb2.GroupStatus.STATE_IDLE_YIELDED and st.loaded_job == "sampler", st
        try:
            stub.Yield(pb2.YieldRequest(job_id="trainer", group_id="g0"), timeout=10)
            raise AssertionError("yield by a non-holder succeeded")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err
    print("OK")


main(sys.argv[1])
