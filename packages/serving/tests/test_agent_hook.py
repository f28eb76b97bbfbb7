"""Registration with a node agent goes through rota_serving's own hook, never an import of rota_agent."""

from __future__ import annotations

import pluggy
import pytest

import rota
import rota_serving.plugin
from rota.rpc import free_port
from rota.testing import new_plugin_manager
from rota_serving import ServeConfig, ServingError, register_with_agent, serve_app
from rota_serving.testing import fake_engine_command


def serving_manager() -> pluggy.PluginManager:
    """A fresh manager with no entry points (rota_agent_client would answer), rota_serving's plugin registered."""
    pm = new_plugin_manager(load_entry_points=False)
    pm.register(rota_serving.plugin)
    return pm


class Registration:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class AgentPlugin:
    """Stands where rota_agent's plugin stands: answers the hook with a registration."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, tuple[str, ...]]] = []
        self.registration = Registration()

    @rota.hookimpl
    def rota_register_with_agent(self, tenant, agent, tags):
        self.calls.append((tenant.tenant, agent, tuple(tags)))
        return self.registration


def test_without_a_plugin_the_error_says_what_to_install(connect):
    gpu = connect("llm")
    with pytest.raises(ServingError, match=r"agent 'unix:/x' .* no installed plugin registers tenants with a node "
                                           r"agent; pip install rota-agent"):
        register_with_agent(serving_manager(), gpu, "unix:/x", ("weights",))


def test_without_rota_servings_plugin_the_error_says_to_load_it(connect):
    pm = new_plugin_manager(load_entry_points=False)  # as with ROTA_LOAD_PLUGINS leaving rota-serving out
    pm.register(AgentPlugin())
    with pytest.raises(ServingError, match=r"plugin is not loaded.*add rota-serving to ROTA_LOAD_PLUGINS"):
        register_with_agent(pm, connect("llm"), "unix:/x", ("weights",))


def test_the_first_plugin_that_answers_registers(connect):
    pm = serving_manager()
    plugin = AgentPlugin()
    pm.register(plugin)
    got = register_with_agent(pm, connect("llm"), "127.0.0.1:9001", ["weights", "kv_cache"])
    assert got is plugin.registration and plugin.calls == [("llm", "127.0.0.1:9001", ("weights", "kv_cache"))]
    assert register_with_agent(pm, connect("llm2"), "127.0.0.1:9001", ()) is got  # firstresult, from the spec


def test_serve_app_registers_with_the_agent_and_closes_the_registration(endpoint):
    plugin = AgentPlugin()
    pm = rota.plugin_manager()  # where rota.connect's Gpu looks; registered last, so asked first
    pm.register(plugin, name="test-agent")
    port = free_port()
    try:
        s = serve_app(ServeConfig(app="sglang", command=fake_engine_command("sglang", port), engine_port=port,
                                  listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="sgl",
                                  agent="127.0.0.1:9", ready_timeout_s=60))
        try:
            assert plugin.calls == [("sgl", "127.0.0.1:9", ("weights", "kv_cache", "cuda_graph"))]
            assert s.workload is plugin.registration and not plugin.registration.closed
        finally:
            s.close(timeout_s=10)
        assert plugin.registration.closed
    finally:
        pm.unregister(plugin)
