"""Replicas on etcd check credentials like the embedded orchestrator: `rota orchestrator serve --etcd URL
--auth-key FILE` as a real child process; a tenant without a token, or with another job's, is refused."""

from __future__ import annotations

import grpc
import pytest

import rota
from rota import auth
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota_etcd.testing import OrchestratorProcess


def test_replica_with_an_auth_key_checks_every_caller(etcd, tmp_path, child_env):
    key_file = str(tmp_path / "auth.key")
    auth.generate_key(key_file)
    key = auth.load_key(key_file)
    with OrchestratorProcess(etcd.url, tmp_path / "replica.log", args=["--auth-key", key_file], env=child_env) as rep:
        bare = pb_grpc.RotaServiceStub(grpc.insecure_channel(rep.endpoint))
        with pytest.raises(grpc.RpcError) as err:
            bare.Acquire(pb.TurnRequest(job_id="j", group_id="g"), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        other = pb_grpc.RotaServiceStub(auth.channel(rep.endpoint, token=auth.issue(key, group="g", job="k")))
        with pytest.raises(grpc.RpcError) as err:
            other.Acquire(pb.TurnRequest(job_id="j", group_id="g"), timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        gpu = rota.connect(group="g", tenant="j", endpoint=rep.endpoint, token=auth.issue(key, group="g", job="j"))
        with gpu.turn() as grant:
            assert grant.token > 0
        gpu.close()
