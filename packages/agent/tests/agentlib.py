"""Small helpers shared by the agent tests: poll an operation, read the rota-owned report fields,
register this very process with an agent through its pid door."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

from rota.wire import snapshot_agent_pb2 as sa
from rota_agent_client import WorkloadClient
from rota_agent_client.extension import ext, read

POLLS = 3000  # GetOperation polls before giving up (bounded by count; pytest's timeout bounds the time)


def wait_op(stub, op_id: str) -> sa.GetOperationResponse:
    """Poll GetOperation until the operation is no longer PENDING."""
    for _ in range(POLLS):
        got = stub.GetOperation(sa.GetOperationRequest(operation_id=op_id), timeout=10)
        if got.status != sa.OPERATION_STATUS_PENDING:
            return got
        time.sleep(0.01)
    raise AssertionError(f"operation {op_id} still pending after {POLLS} polls")


def run_op(stub, kind: str, job_id: str, group: str = "", **kw) -> sa.GetOperationResponse:
    """Start a Snapshot or Restore and wait for its end."""
    if kind == "snapshot":
        op = stub.Snapshot(sa.SnapshotRequest(job_id=job_id, group=group, **kw), timeout=10).operation_id
    else:
        op = stub.Restore(sa.RestoreRequest(job_id=job_id, group=group, **kw), timeout=10).operation_id
    return wait_op(stub, op)


def jobs(stub) -> dict[str, tuple[int, ext.JobStatusExt]]:
    """job_id -> (JobState, rota-owned fields: residue, fault) from Status."""
    st = stub.Status(sa.StatusRequest(), timeout=10)
    return {j.job_id: (j.state, read(j, ext.JobStatusExt)) for j in st.job_statuses}


def residue(got: sa.GetOperationResponse) -> ext.Residue:
    return read(got, ext.GetOperationResponseExt).residue


@contextlib.contextmanager
def registered_here(socket_dir: str, job_id: str = "whole", group: str = "g",
                    backend: str = "app_channel") -> Iterator[WorkloadClient]:
    """Register this test process as ``job_id`` over the agent's Unix socket: the door proves its pid, so its
    children (e.g. the ``target`` fixture) are processes the job may name in a cuda explicit target."""
    client = WorkloadClient(f"unix:{os.path.join(socket_dir, 'agent.sock')}", job_id, group,
                            on_snapshot=lambda *_: None, on_restore=lambda *_: None, backend=backend)
    try:
        yield client.wait_registered()
    finally:
        client.close()
