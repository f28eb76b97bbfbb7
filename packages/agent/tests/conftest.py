"""Fixtures of rota-agent's tests: an agent and an orchestrator on loopback, tenant processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import grpc
import pytest

from rota.orchestrator import OrchestratorConfig
from rota.testing import ScriptedProcess, running_orchestrator
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota.wire import timeslice_orchestrator_pb2_grpc as v1a_grpc
from rota_agent import Agent, running_agent

HERE = os.path.dirname(os.path.abspath(__file__))


class Tenant(ScriptedProcess):
    """A tenant_proc.py subprocess; every read has a timeout."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        super().__init__(os.path.join(HERE, "tenant_proc.py"), args, env, timeout=30)


@pytest.fixture
def child_env(child_env: dict[str, str], tmp_path) -> dict[str, str]:
    """rota.fixtures' environment for tenant subprocesses, loading no plugins (the tenants register what they
    use), with a short runtime dir."""
    return {**child_env, "ROTA_RUNTIME_DIR": str(tmp_path / "rt"), "ROTA_LOAD_PLUGINS": ""}


@pytest.fixture
def socket_dir() -> Iterator[str]:
    """A short private directory for an agent's Unix sockets (a socket path must fit in 108 bytes)."""
    path = tempfile.mkdtemp(prefix="rota-agent-t")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def agent(socket_dir) -> Iterator[tuple[str, Agent]]:
    """An agent on loopback TCP, also serving ``unix:<socket_dir>/agent.sock`` and its pid door."""
    with running_agent(socket_dir=socket_dir) as served:
        yield served


@pytest.fixture
def agent_stub(agent) -> Iterator[sa_grpc.SnapshotAgentServiceStub]:
    with grpc.insecure_channel(agent[0]) as ch:
        yield sa_grpc.SnapshotAgentServiceStub(ch)


@pytest.fixture
def cluster(agent):
    """(orchestrator endpoint, agent endpoint, v1alpha1 stub): an orchestrator that knows the agent."""
    with running_orchestrator(OrchestratorConfig(ttl_s=3.0, park_timeout_s=20.0, agents=(agent[0],))) as (ep, _):
        with grpc.insecure_channel(ep) as ch:
            yield ep, agent[0], v1a_grpc.TimeSliceOrchestratorServiceStub(ch)


@pytest.fixture
def tenants(child_env) -> Iterator:
    started: list[Tenant] = []

    def start(*args: str) -> Tenant:
        t = Tenant(list(args), child_env)
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop()


@pytest.fixture
def target():
    """A live process to point pid-based backends at (sleeps; killed afterwards)."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield p.pid
    p.kill()
    p.wait(5)
