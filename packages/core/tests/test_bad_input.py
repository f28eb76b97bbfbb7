"""Bad input gets the v1alpha1 API's status code, a message naming the value, and changes nothing."""

from __future__ import annotations

import grpc
import pytest
from click.testing import CliRunner

import rota
from rota.cli.main import cli
from rota.errors import ConfigError
from rota.orchestrator import OrchestratorConfig
from rota.testing import running_orchestrator
from rota.wire import rota_v1_pb2 as pb
from rota.wire import rota_v1_pb2_grpc as pb_grpc
from rota.wire import timeslice_orchestrator_pb2 as v1a
from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc


@pytest.fixture
def stub(orchestrator):
    endpoint, engine = orchestrator
    with grpc.insecure_channel(endpoint) as ch:
        yield v1a_grpc.TimeSliceOrchestratorServiceStub(ch), engine


@pytest.mark.parametrize("job,group,needle", [
    ("", "g", "job_id is empty"),
    ("a", "", "group_id is empty"),
    ("bad job", "g", "'bad job' is malformed"),
    ("a", "g/../x", "'g/../x' is malformed"),
    ("-lead", "g", "'-lead' is malformed"),
])
def test_malformed_ids_are_invalid_argument(stub, job, group, needle):
    s, engine = stub
    with pytest.raises(grpc.RpcError) as err:
        s.Acquire(v1a.AcquireRequest(job_id=job, group_id=group), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in err.value.details()
    assert engine.groups == {}


def test_yield_by_non_holder_is_permission_denied(stub):
    s, engine = stub
    s.Acquire(v1a.AcquireRequest(job_id="a", group_id="g"), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        s.Yield(v1a.YieldRequest(job_id="b", group_id="g"), timeout=5)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'b'" in err.value.details() and "'g'" in err.value.details()
    assert engine.groups["g"].holder == "a"


def test_unknown_group_with_fixed_groups_is_not_found():
    with running_orchestrator(OrchestratorConfig(groups=("g0",))) as (endpoint, engine):
        with grpc.insecure_channel(endpoint) as ch:
            s = v1a_grpc.TimeSliceOrchestratorServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                s.Acquire(v1a.AcquireRequest(job_id="a", group_id="nope"), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert "'nope'" in err.value.details() and "--groups" in err.value.details()
            assert "g0" not in err.value.details()  # other groups' names are not given away (issue 30)
            assert list(engine.groups) == ["g0"]
            with pytest.raises(grpc.RpcError) as err:
                s.GetGroupStatus(v1a.GetGroupStatusRequest(group_id="nope"), timeout=5)
            assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_impossible_rank_is_invalid_argument(orchestrator):
    endpoint, engine = orchestrator
    with grpc.insecure_channel(endpoint) as ch:
        with pytest.raises(grpc.RpcError) as err:
            pb_grpc.RotaServiceStub(ch).Acquire(pb.TurnRequest(job_id="a", group_id="g", world_size=2, rank=5))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "rank 5" in err.value.details()
    assert "a" not in engine.groups.get("g", type("E", (), {"tenants": {}})()).tenants


@pytest.mark.parametrize("var,value,needle", [
    ("ROTA_WORLD_SIZE", "zero", "ROTA_WORLD_SIZE='zero' is not an integer"),
    ("ROTA_WORLD_SIZE", "0", "ROTA_WORLD_SIZE='0' is below 1"),
    ("ROTA_WEIGHT", "-1", "ROTA_WEIGHT='-1' must be > 0"),
    ("ROTA_ORCHESTRATOR", "nohost", "'nohost' is not host:port"),
    ("ROTA_PRIORITY", "high", "ROTA_PRIORITY='high' is not an integer"),
    ("ROTA_GROUP", "a b", "'a b' is malformed"),
])
def test_bad_env_values_are_named(monkeypatch, var, value, needle):
    monkeypatch.setenv("ROTA_ORCHESTRATOR", "127.0.0.1:1")
    monkeypatch.setenv(var, value)
    with pytest.raises(rota.RotaError) as err:
        rota.connect(tenant="t")
    assert needle in str(err.value)


def test_multi_rank_without_tenant_is_a_config_error(monkeypatch):
    monkeypatch.setenv("ROTA_ORCHESTRATOR", "127.0.0.1:1")
    monkeypatch.setenv("ROTA_WORLD_SIZE", "2")
    monkeypatch.setenv("ROTA_RANK", "1")
    monkeypatch.delenv("ROTA_TENANT", raising=False)
    with pytest.raises(ConfigError, match="ROTA_TENANT"):
        rota.connect()


def test_torchrun_ranks_win_over_inherited_rota_ranks(monkeypatch):
    """A torchrun worker under a Slurm task inherits the task's ROTA_RANK: torchrun's own RANK must win."""
    from rota._tenant.client import _ranks

    monkeypatch.setenv("ROTA_WORLD_SIZE", "4")
    monkeypatch.setenv("ROTA_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-7")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert _ranks() == (1, 2)
    monkeypatch.setenv("RANK", "3")
    with pytest.raises(ConfigError, match="RANK=3 must be below WORLD_SIZE=2"):
        _ranks()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")  # not under torchrun: the ROTA_* values are this process's
    assert _ranks() == (0, 4)


@pytest.mark.parametrize("args,needle", [
    (["orchestrator", "serve", "--listen", "nowhere"], "'nowhere' is not host:port"),
    (["orchestrator", "serve", "--policy", "lottery"], "unknown policy 'lottery'"),
    (["orchestrator", "serve", "--capacity", "lots"], "'lots' is not a size"),
    (["orchestrator", "serve", "--ttl", "0"], "Invalid value for '--ttl': 0.0 is not in the range x>0"),
    (["orchestrator", "serve", "--groups", "ok,no way"], "'no way' is malformed"),
    (["status", "bad group"], "'bad group' is malformed"),
])
def test_bad_cli_flags(args, needle):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, result.output
    assert needle in result.output
