"""Verified release: after a park the agent checks what the job still holds on the device.

The adapter path is all real: a tenant subprocess tracks a torch model with rota_fsdp
(on CPU) and hangs a tensor off it that rota does not park; its park reports that
residue over the WorkloadChannel and the agent faults the job over its limit.

The NVML path uses ``FakeNvmlReader`` — a fake, because this machine has no GPU and no
NVML: it stands in for :func:`rota.nvml.process_bytes_by_pid` only. The agent,
its gRPC, the (fake-driver) cuda backend and the target process are real.
"""

from __future__ import annotations

import grpc
import pytest
from agentlib import jobs, registered_here, residue, run_op
from test_cuda_backend import FakeCudaDriver

from rota.errors import ConfigError
from rota.orchestrator import OrchestratorConfig
from rota.residue import DEFAULT_RESIDUE_MAX_BYTES
from rota.testing import running_orchestrator
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import Agent, running_agent
from rota_agent.backends import AppChannelBackend, CudaBackend, NoopBackend

MiB = 1 << 20


class FakeNvmlReader:
    """FAKE of NVML's per-process used memory (no GPU here): pid -> bytes, as set by the test."""

    def __init__(self, per_pid: dict[int, int] | None = None) -> None:
        self.per_pid = per_pid or {}
        self.asked: list[tuple[int, ...]] = []

    def __call__(self, pids: tuple[int, ...]) -> dict[int, int]:
        self.asked.append(pids)
        return {p: self.per_pid.get(p, 0) for p in pids}


def _cuda_req(pid: int) -> dict:
    return {"backend_config": sa.BackendConfig(cuda=sa.CudaBackendConfig(explicit_target=sa.ProcessTarget(pids=[pid])))}


def test_forgotten_tensor_fails_the_park_names_it_and_the_job_can_retry(tenants, caplog):
    pytest.importorskip("rota_fsdp")
    with running_orchestrator(OrchestratorConfig(ttl_s=5.0)) as (orch, _), \
            running_agent(Agent(residue_max_bytes=MiB)) as (ep, _), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        t = tenants("--mode", "fsdp", "--orch", orch, "--agent", ep, "--job", "leaky", "--group", "g",
                    "--leak-bytes", str(4 * MiB))
        got = run_op(stub, "snapshot", "leaky")
        assert got.status == sa.OPERATION_STATUS_FAILED
        assert "untracked:0.cache 4.0 MiB" in got.error and "ROTA_RESIDUE_MAX_BYTES" in got.error
        left = residue(got)
        assert left.bytes["untracked:0.cache"] == 4 * MiB and left.counted_bytes == 4 * MiB
        assert left.limit_bytes == MiB
        state, more = jobs(stub)["leaky"]
        assert state == sa.JOB_STATE_FAULTED and "untracked:0.cache" in more.fault
        assert more.residue.counted_bytes == 4 * MiB
        assert "FAULTED" in caplog.text and "untracked:0.cache" in caplog.text  # the logged message names it
        check = t.ask("check")
        assert check["parked"] is True and check["weights_resident"] is False  # the state stayed parked

        again = run_op(stub, "snapshot", "leaky")  # retried without a restart: still there, still refused
        assert again.status == sa.OPERATION_STATUS_FAILED and "untracked:0.cache" in again.error

        assert t.ask("acquire")["cmd"] == "acquire"  # the tenant's next turn restores it (core, lazily)
        t.ask("free")
        t.ask("release")
        fixed = run_op(stub, "snapshot", "leaky")
        assert fixed.status == sa.OPERATION_STATUS_COMPLETE, fixed.error
        assert residue(fixed).counted_bytes == 0 and "untracked:0.cache" not in residue(fixed).bytes
        state, more = jobs(stub)["leaky"]
        assert state == sa.JOB_STATE_SAVED and more.fault == ""
        assert run_op(stub, "restore", "leaky").status == sa.OPERATION_STATUS_COMPLETE
        assert t.ask("check")["weights_resident"] is True


def test_nvml_bytes_left_by_a_whole_process_park_fail_it(target, socket_dir):
    nvml = FakeNvmlReader({target: 512 * MiB})  # the driver "released" less than it should have
    drv = FakeCudaDriver()
    agent = Agent({"cuda": CudaBackend(lambda: drv), "app_channel": AppChannelBackend()}, process_bytes=nvml)
    assert agent.residue_max_bytes == DEFAULT_RESIDUE_MAX_BYTES
    with running_agent(agent, socket_dir=socket_dir) as (ep, _), registered_here(socket_dir), \
            grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        got = run_op(stub, "snapshot", "whole", "g", **_cuda_req(target))
        assert got.status == sa.OPERATION_STATUS_FAILED
        assert f"pid {target} holds 512.0 MiB" in got.error and "limit 256.0 MiB" in got.error
        assert residue(got).bytes[f"nvml:pid:{target}"] == 512 * MiB
        state, more = jobs(stub)["whole"]
        assert state == sa.JOB_STATE_FAULTED and str(target) in more.fault
        assert nvml.asked == [(target,)]

        nvml.per_pid[target] = 0  # released after all: a retry re-measures and completes
        retry = run_op(stub, "snapshot", "whole", "g", **_cuda_req(target))
        assert retry.status == sa.OPERATION_STATUS_COMPLETE, retry.error
        assert residue(retry).bytes[f"nvml:pid:{target}"] == 0 and residue(retry).counted_bytes == 0
        assert jobs(stub)["whole"][0] == sa.JOB_STATE_SAVED
        assert run_op(stub, "restore", "whole", "g").status == sa.OPERATION_STATUS_COMPLETE


def test_nvml_bytes_of_a_live_process_are_reported_not_counted(tenants, socket_dir):
    """An app_channel/noop tenant keeps its CUDA context after a park: NVML sees it, no park could free it.
    The tenant registers over the agent's Unix socket, so the pid door proves its pid."""
    nvml = FakeNvmlReader()
    agent = Agent({"noop": NoopBackend(), "app_channel": AppChannelBackend()}, process_bytes=nvml,
                  residue_max_bytes=MiB)
    with running_agent(agent, socket_dir=socket_dir) as (ep, _), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        t = tenants("--mode", "v1", "--orch", "127.0.0.1:1", "--agent", f"unix:{socket_dir}/agent.sock",
                    "--job", "ctx", "--group", "g", "--backend", "noop")
        nvml.per_pid[t.ready["pid"]] = 500 * MiB
        got = run_op(stub, "snapshot", "ctx")
        assert got.status == sa.OPERATION_STATUS_COMPLETE, got.error
        assert residue(got).bytes[f"nvml:pid:{t.ready['pid']}"] == 500 * MiB and residue(got).counted_bytes == 0


def test_zero_limit_turns_the_check_off(target, socket_dir):
    drv = FakeCudaDriver()
    agent = Agent({"cuda": CudaBackend(lambda: drv), "app_channel": AppChannelBackend()},
                  process_bytes=FakeNvmlReader({target: 10 << 30}), residue_max_bytes=0)
    with running_agent(agent, socket_dir=socket_dir) as (ep, _), registered_here(socket_dir), \
            grpc.insecure_channel(ep) as ch:
        got = run_op(sa_grpc.SnapshotAgentServiceStub(ch), "snapshot", "whole", "g", **_cuda_req(target))
    assert got.status == sa.OPERATION_STATUS_COMPLETE and residue(got).counted_bytes == 10 << 30


def test_bad_limits_name_the_value(monkeypatch):
    with pytest.raises(ConfigError, match=r"residue_max_bytes=-1 .*0 disables"):
        Agent(residue_max_bytes=-1)
    monkeypatch.setenv("ROTA_RESIDUE_MAX_BYTES", "lots")
    with pytest.raises(ConfigError, match=r"ROTA_RESIDUE_MAX_BYTES='lots' is not a size"):
        Agent()
    monkeypatch.setenv("ROTA_RESIDUE_MAX_BYTES", "4096")
    assert Agent().residue_max_bytes == 4096
    monkeypatch.setenv("ROTA_RESIDUE_MAX_BYTES", "1.5GB")  # the same units as core's limit
    assert Agent().residue_max_bytes == 1_500_000_000
