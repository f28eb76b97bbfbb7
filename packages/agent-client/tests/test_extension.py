"""rota's residue fields ride inside v1alpha1 messages without changing them: a v1alpha1
peer parses the bytes and sees only its own fields; the committed stubs of
agent_ext.proto equal a fresh generation with the pinned grpcio-tools."""

from __future__ import annotations

import filecmp
import pathlib

import pytest

from rota.wire import snapshot_agent_pb2 as sa
from rota_agent_client.extension import attach, ext, read

PKG = pathlib.Path(__file__).resolve().parent.parent


def test_v1alpha1_peer_sees_only_its_fields_and_rota_reads_the_rest():
    base = sa.GetOperationResponse(status=sa.OPERATION_STATUS_COMPLETE, elapsed_ms=7, error="x")
    more = ext.GetOperationResponseExt(residue=ext.Residue(bytes={"untracked:cache": 5}, counted_bytes=5))
    sent = attach(base, more).SerializeToString()
    peer = sa.GetOperationResponse.FromString(sent)
    assert (peer.status, peer.elapsed_ms, peer.error) == (base.status, 7, "x")
    assert {f.name for f, _ in peer.ListFields()} == {"status", "error", "elapsed_ms"}
    assert read(peer, ext.GetOperationResponseExt).residue == more.residue
    assert not read(base, ext.GetOperationResponseExt).HasField("residue")  # nothing sent, nothing read
    assert {f.number for f in ext.JobStatusExt.DESCRIPTOR.fields} == {1000, 1001}
    assert not {f.number for f in sa.JobStatus.DESCRIPTOR.fields} & {1000, 1001}
    reg = attach(sa.RegisterWorkload(job_id="j", group="g"), ext.RegisterWorkloadExt(app=1, endpoints=["http://h:1"]))
    assert sa.RegisterWorkload.FromString(reg.SerializeToString()).job_id == "j"  # a v1alpha1 agent still reads it
    assert list(read(reg, ext.RegisterWorkloadExt).endpoints) == ["http://h:1"]
    assert not {f.number for f in sa.RegisterWorkload.DESCRIPTOR.fields} & \
        {f.number for f in ext.RegisterWorkloadExt.DESCRIPTOR.fields}


def test_committed_stubs_are_reproducible(tmp_path):
    protoc = pytest.importorskip("grpc_tools.protoc")
    proto = PKG / "proto"
    assert protoc.main(["protoc", f"-I{proto}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
                        str(proto / "rota_agent_client/_generated/agent_ext.proto")]) == 0
    for name in ("agent_ext_pb2.py", "agent_ext_pb2.pyi"):
        fresh = tmp_path / "rota_agent_client/_generated" / name
        committed = PKG / "src/rota_agent_client/_generated" / name
        assert filecmp.cmp(fresh, committed, shallow=False), (
            f"{committed} is stale; regenerate: cd packages/agent-client && python -m grpc_tools.protoc -Iproto "
            "--python_out=src --pyi_out=src proto/rota_agent_client/_generated/agent_ext.proto")
