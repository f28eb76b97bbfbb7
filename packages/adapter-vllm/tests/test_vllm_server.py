"""``rota vllm serve``'s pieces over the fake vLLM engine: the version check at start, the weight-sync routes.

The serving machinery itself (proxy, turn gate, parking) is tested in packages/serving/tests.
"""

from __future__ import annotations

import pytest

from rota.rpc import free_port
from rota_serving import EndpointClient, ServeConfig, ServingError, serve_app
from rota_serving.testing import fake_engine_command, get_json
from rota_vllm import UnsupportedVersion, VllmServer, check_server


@pytest.fixture
def served(endpoint):
    port = free_port()
    s = serve_app(ServeConfig(app="vllm", command=fake_engine_command("vllm", port), engine_port=port,
                              listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="llm", agent="",
                              idle_release_s=0.0, ready_timeout_s=60, check_version=check_server))
    yield s
    s.close(timeout_s=10)


def test_weight_sync_routes_reach_the_engine(served):
    engine = VllmServer(served.client.base_url)
    got = engine.collective_rpc("reload_weights")
    assert got == [{"method": "reload_weights", "args": []}]
    engine.reset_prefix_cache()
    calls = get_json(engine.base_url + "/fake/calls")["calls"]
    assert "GET /version" in calls and "POST /reset_prefix_cache" in calls


def test_an_unsupported_server_is_refused_and_stopped(endpoint):
    port = free_port()
    command = [*fake_engine_command("vllm", port), "--version", "0.9.2"]
    with pytest.raises(UnsupportedVersion, match=r"vllm 0\.9\.2 \(server at http://127\.0\.0\.1:\d+\) is not "
                                                 r"supported by rota-adapter-vllm"):
        serve_app(ServeConfig(app="vllm", command=command, engine_port=port, listen="127.0.0.1:0",
                              orchestrator=endpoint, group="g", tenant="old", agent="", ready_timeout_s=60,
                              check_version=check_server))
    with pytest.raises(ServingError, match="failed"):  # the engine was stopped again
        EndpointClient("vllm", f"http://127.0.0.1:{port}", timeout_s=5).call("GET", "/health")
