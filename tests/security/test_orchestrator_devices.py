"""Issue 32: a group over several GPUs adds a request field (TurnRequest.devices) and per-device lanes.

The orchestrator checks tokens (``ServerAuth(key=...)``); the attacker holds a valid token for its own job only.
Devices are bounded and checked before anything reads them, a bad name is not echoed back whole, a lane is no
way into another group (its id is never a valid group id), and a tenant's status shows only its own group's lanes.
"""

from __future__ import annotations

import grpc
import pytest

import rota
from rota import auth
from rota.errors import InvalidArgument
from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc

KEY = b"k" * 32


def _refused(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details() or ""


def test_devices_are_bounded_checked_and_not_echoed():
    with running_orchestrator(OrchestratorConfig(capacity_bytes=10_000), auth=auth.ServerAuth(key=KEY)) as (
            endpoint, engine):
        mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="g", job="m")))
        for devices, says in ((["cuda:0"] * 100_000, "at most 64"), (["cuda:0", "A" * 100_000], "not a device"),
                              (["cuda:0", "cuda:0"], "twice"), (["../../etc"], "not a device"),
                              (["cuda:99999"], "not a device")):
            code, details = _refused(lambda d=devices: mallory.Acquire(
                pb.TurnRequest(job_id="m", group_id="g", devices=d), timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and says in details, details
            assert len(details) < 1000 and "A" * 100 not in details
        assert not [gid for gid in engine.groups if "@" in gid]  # nothing was created for a refused request


def test_a_lane_is_no_way_into_another_group_and_status_shows_only_ones_own_lanes():
    with running_orchestrator(OrchestratorConfig(capacity_bytes=10_000), auth=auth.ServerAuth(key=KEY)) as (
            endpoint, _):
        victim = rota.connect(group="victim", tenant="v", endpoint=endpoint, devices="fake:0,fake:1",
                              token=auth.issue(KEY, group="victim", job="v"))
        try:
            assert victim.acquire().device == "fake:0"
            mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="m", job="m")))
            for lane in ("victim@fake:0", "victim@fake:1"):  # a lane's id is not a group id: refused before any lookup
                code, _ = _refused(lambda g=lane: mallory.Acquire(pb.TurnRequest(job_id="m", group_id=g), timeout=5))
                assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
                code, _ = _refused(lambda g=lane: mallory.Status(pb.StatusRequest(group_id=g), timeout=5))
                assert code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED)
            mine = rota.connect(group="m", tenant="m", endpoint=endpoint, devices="fake:0",
                                token=auth.issue(KEY, group="m", job="m"))
            try:
                mine.acquire()
                seen = [g.group_id for g in mallory.Status(pb.StatusRequest(), timeout=5).groups]
                assert seen and all(g.split("@")[0] == "m" for g in seen), seen
                mine.release()
            finally:
                mine.close()
            victim.release()
        finally:
            victim.close()


def test_a_device_the_host_lacks_is_refused_and_makes_no_lane():
    """Issue 45 row 6: ``Acquire(g, devices=['cuda:7'])`` on a host without it made lane g@cuda:7, and every tenant
    of g that names no devices was refused for as long as that lane was remembered (600 s)."""
    with running_orchestrator(OrchestratorConfig(), auth=auth.ServerAuth(key=KEY)) as (endpoint, engine):
        mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="g", job="m")))
        code, details = _refused(lambda: mallory.Acquire(  # this host's own GPUs (/dev/nvidia*), or 64 at most
            pb.TurnRequest(job_id="m", group_id="g", devices=["cuda:999"]), timeout=10))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not exist on this host" in details, details
        assert [gid for gid in engine.groups if gid.startswith("g")] == []  # no lane, no group
    with running_orchestrator(OrchestratorConfig(capacity_bytes=10_000, devices=2),
                              auth=auth.ServerAuth(key=KEY)) as (endpoint, engine):
        mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="g", job="m")))
        for devices in (["cuda:7"], ["cuda:0", "cuda:2"], ["fake:2"]):
            code, details = _refused(lambda d=devices: mallory.Acquire(
                pb.TurnRequest(job_id="m", group_id="g", devices=d), timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, details
            assert "does not exist on this host (it has " in details and "--devices N" in details, details
        assert [gid for gid in engine.groups if gid.startswith("g")] == []
        victim = rota.connect(group="g", tenant="v", endpoint=endpoint, token=auth.issue(KEY, group="g", job="v"))
        try:
            assert victim.acquire().device == ""  # a group of one device, as before the attack
            victim.release()
        finally:
            victim.close()


def test_lanes_go_with_their_last_job():
    """A tenant that used a lane and left (its own Evict) leaves nothing that refuses the group's other tenants;
    while it is on the device, a tenant naming no devices is refused as one naming devices is refused beside
    tenants that name none."""
    with running_orchestrator(OrchestratorConfig(capacity_bytes=10_000), auth=auth.ServerAuth(key=KEY)) as (
            endpoint, engine):
        mallory = pb_grpc.RotaServiceStub(auth.channel(endpoint, token=auth.issue(KEY, group="g", job="m")))
        grant = mallory.Acquire(pb.TurnRequest(job_id="m", group_id="g", devices=["fake:0"]), timeout=10)
        mallory.Release(pb.ReleaseRequest(job_id="m", group_id="g", token=grant.token), timeout=10)
        victim = rota.connect(group="g", tenant="v", endpoint=endpoint, token=auth.issue(KEY, group="g", job="v"))
        try:
            with pytest.raises(InvalidArgument, match="spans devices"):
                victim.acquire()  # mallory's state is on fake:0
            mallory.Evict(pb.EvictRequest(job_id="m", group_id="g", reason="done"), timeout=10)
            assert not [gid for gid in engine.groups if "@" in gid]  # the lane went with its last job
            assert victim.acquire().device == ""  # was INVALID_ARGUMENT "group 'g' spans devices" for 600 s
            victim.release()
            code, _ = _refused(lambda: mallory.Acquire(  # and now the group is the victim's kind
                pb.TurnRequest(job_id="m", group_id="g", devices=["fake:0"]), timeout=10))
            assert code == grpc.StatusCode.INVALID_ARGUMENT
        finally:
            victim.close()
