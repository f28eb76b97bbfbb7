"""Fencing tokens only grow, and a release with a stale token is refused."""

from __future__ import annotations

import grpc
import pytest

import rota
from rota.errors import StaleToken
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc


def test_stale_token_is_refused_and_changes_nothing(orchestrator):
    endpoint, engine = orchestrator
    gpu = rota.connect(group="g", tenant="a", endpoint=endpoint)
    first = gpu.acquire()
    gpu.release()
    second = gpu.acquire()
    assert second.token > first.token
    with grpc.insecure_channel(endpoint) as ch:
        stub = pb_grpc.RotaServiceStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.Release(pb.ReleaseRequest(job_id="a", group_id="g", token=first.token))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert f"token {first.token}" in err.value.details() and "'a'" in err.value.details()
    assert engine.groups["g"].holder == "a" and engine.groups["g"].token == second.token
    gpu.release()
    gpu.close()


def test_stale_token_maps_to_typed_error(orchestrator):
    endpoint, _ = orchestrator
    gpu = rota.connect(group="g", tenant="a", endpoint=endpoint)
    old = gpu.acquire()
    gpu.release()
    gpu.acquire()
    with pytest.raises(StaleToken):
        gpu.pm.hook.rota_release(request=rota.ReleaseRequest(old), link=gpu.link)
    gpu.close()


def test_holder_reacquire_is_idempotent(orchestrator):
    endpoint, _ = orchestrator
    gpu = rota.connect(group="g", tenant="a", endpoint=endpoint)
    grant = gpu.acquire()
    with grpc.insecure_channel(endpoint) as ch:
        again = pb_grpc.RotaServiceStub(ch).Acquire(pb.TurnRequest(job_id="a", group_id="g"), timeout=5)
    assert again.token == grant.token
    gpu.close()
