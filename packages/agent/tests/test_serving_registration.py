"""rota_agent answers rota_serving's ``rota_register_with_agent`` hook: ``rota vllm serve --agent`` registers
its tenant here through the hook (found by name; neither package imports the other)."""

from __future__ import annotations

import pytest
from agentlib import jobs, run_op

from rota import ParkResult, hookimpl
from rota.testing import new_plugin_manager, quick_config, running_orchestrator, tenants
from rota.wire import snapshot_agent_pb2 as sa


class EngineHooks:
    """The served engine's park hooks (rota_serving's EndpointParker stands here)."""

    def __init__(self, gpu) -> None:
        self.gpu, self.parked = gpu, []

    @hookimpl
    def rota_park(self, tenant, plan):
        if tenant is self.gpu:
            self.parked.append(plan.mode.value)
            return ParkResult(seconds=0.0)
        return None


def test_a_served_engines_tenant_registers_through_the_hook(agent, agent_stub):
    serving = pytest.importorskip("rota_serving")  # installed by ./dev setup; the hook's owner
    pm = new_plugin_manager()  # entry points, rota_agent's plugin among them
    with running_orchestrator(quick_config()) as (ep, _), tenants(ep) as connect:
        gpu = connect("served")
        hooks = EngineHooks(gpu)
        gpu.pm.register(hooks)
        link = serving.register_with_agent(pm, gpu, agent[0], ("weights", "kv_cache"))
        try:
            link.wait_registered()
            assert "served" in jobs(agent_stub)
            assert run_op(agent_stub, "snapshot", "served", "g").status == sa.OPERATION_STATUS_COMPLETE
            assert jobs(agent_stub)["served"][0] == sa.JOB_STATE_SAVED and hooks.parked == ["offload"]
        finally:
            link.close()
            gpu.pm.unregister(hooks)
