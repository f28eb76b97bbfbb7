"""A park backend is a plugin: one module with a ``rota_agent_backends`` hookimpl, found the way an
installed distribution's would be, offered by ``rota agent serve`` beside the built-in ones."""

from __future__ import annotations

import grpc
import pytest
from agentlib import registered_here, run_op

from rota import hookimpl
from rota.errors import ConfigError
from rota.testing import new_plugin_manager
from rota.wire import snapshot_agent_pb2 as sa
from rota.wire import snapshot_agent_pb2_grpc as sa_grpc
from rota_agent import Agent, running_agent
from rota_agent.backends import Moved, available_backends


class RecordingBackend:
    """A third party's backend: it records what it was asked to do and moves nothing."""

    name = "recording"
    whole_process = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def parse(self, job, job_id, config):
        return None

    async def snapshot(self, job, config) -> Moved:
        self.calls.append(("snapshot", job.job_id))
        return Moved(0, 0)

    async def restore(self, job, config) -> Moved:
        self.calls.append(("restore", job.job_id))
        return Moved(0, 0)


class ThirdPartyPlugin:
    """What a distribution's ``plugin.py`` would hold."""

    def __init__(self) -> None:
        self.backend = RecordingBackend()

    @hookimpl
    def rota_agent_backends(self, step_timeout_s):
        return {"recording": self.backend}


def test_a_plugin_backend_is_offered_beside_the_builtins_and_parks_a_job(socket_dir):
    pm = new_plugin_manager()  # with the entry points: rota_agent's own plugin offers the built-ins
    plugin = ThirdPartyPlugin()
    pm.register(plugin, name="third-party")
    backends = available_backends(pm, step_timeout_s=5.0)
    assert {"app_channel", "cuda", "app_endpoint", "noop", "recording"} <= set(backends)
    agent = Agent(backends)
    with running_agent(agent, socket_dir=socket_dir) as (ep, _), \
            registered_here(socket_dir, job_id="rec", backend="recording"), grpc.insecure_channel(ep) as ch:
        stub = sa_grpc.SnapshotAgentServiceStub(ch)
        assert run_op(stub, "snapshot", "rec", "g").status == sa.OPERATION_STATUS_COMPLETE
        assert run_op(stub, "restore", "rec", "g").status == sa.OPERATION_STATUS_COMPLETE
    assert plugin.backend.calls == [("snapshot", "rec"), ("restore", "rec")]


def test_two_plugins_offering_one_backend_name_is_an_error_naming_both():
    pm = new_plugin_manager()
    pm.register(ThirdPartyPlugin(), name="first")
    pm.register(ThirdPartyPlugin(), name="second")
    with pytest.raises(ConfigError, match=r"'recording' is offered by both (first and second|second and first)"):
        available_backends(pm)


def test_without_rota_agents_plugin_the_error_says_to_load_it():
    pm = new_plugin_manager(load_entry_points=False)  # as with ROTA_LOAD_PLUGINS leaving rota-agent out
    pm.register(ThirdPartyPlugin(), name="third-party")
    with pytest.raises(ConfigError, match=r"rota-agent's plugin is not loaded.*add rota-agent to ROTA_LOAD_PLUGINS"):
        available_backends(pm)
