"""serve_app against the fake vLLM engine and a real orchestrator: park, wait-for-turn, restore.

The engine is the fake (a subprocess, started by :func:`rota_serving.serve_app` exactly
as ``rota vllm serve`` starts vLLM); rota, the proxy and the HTTP protocol are real.
"""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest

import rota
from rota.errors import ConfigError
from rota.rpc import free_port
from rota_serving import EndpointClient, ServeConfig, ServingError, serve_app, track_endpoint
from rota_serving.testing import fake_engine_command, get_json, post_json


def _calls(engine: str) -> list[str]:
    return get_json(engine + "/fake/calls")["calls"]


@pytest.fixture
def served(endpoint):
    port = free_port()
    checked: list[str] = []
    cfg = ServeConfig(app="vllm", command=fake_engine_command("vllm", port), engine_port=port,
                      listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="llm", agent="",
                      idle_release_s=0.0, ready_timeout_s=60, check_version=lambda c: checked.append(c.base_url))
    s = serve_app(cfg)
    assert checked == [s.client.base_url]  # the version check ran against the engine, before the proxy
    yield s
    s.close(timeout_s=10)


def test_request_while_parked_waits_for_the_turn_then_succeeds(served, connect):
    engine = EndpointClient("vllm", served.client.base_url)
    code, got = post_json(served.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert code == 200 and got["choices"][0]["text"] == " tok1"
    assert engine.is_sleeping() is False

    trainer = connect("trainer")
    trainer.acquire()  # the orchestrator parks the resident engine first: /sleep?level=1
    assert engine.is_sleeping() is True
    assert "POST /sleep?level=1" in _calls(engine.base_url)
    assert served.parker.dropped == ("kv_cache",)

    before = sum("/v1/completions" in c for c in _calls(engine.base_url))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=post_json(served.url + "/v1/completions", {"prompt": "x"})))
    t.start()
    t.join(0.5)
    assert t.is_alive(), f"the request did not wait for the engine's turn: {result}"
    assert sum("/v1/completions" in c for c in _calls(engine.base_url)) == before, "reached the engine while parked"

    trainer.release()
    t.join(30)
    assert not t.is_alive()
    code, got = result["r"]
    assert code == 200 and got["choices"][0]["text"] == " tok2"
    calls = _calls(engine.base_url)
    assert calls.index("POST /wake_up") < max(i for i, c in enumerate(calls) if "/v1/completions" in c)
    assert engine.is_sleeping() is False

    code, got = post_json(served.url + "/v1/completions", {"prompt": "again"})  # generation continues
    assert code == 200 and got["choices"][0]["text"] == " tok3"


def test_streamed_completion_is_relayed_chunk_by_chunk(served):
    req = urllib.request.Request(served.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "s", "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=30) as r:
        body = r.read().decode()
    assert body.count("data: ") == 2 and body.rstrip().endswith("data: [DONE]")


def test_free_paths_need_no_turn_and_control_paths_are_refused(served, connect):
    trainer = connect("trainer")
    trainer.acquire()
    with urllib.request.urlopen(served.url + "/health", timeout=10) as r:
        assert r.status == 200  # answered while the trainer holds the group
    code, got = post_json(served.url + "/sleep?level=2", {})
    assert code == 409 and "managed by rota" in got["error"]["message"]
    trainer.release()


def test_discard_mode_sleeps_at_level_2(endpoint, connect):
    port = free_port()
    cfg = ServeConfig(app="vllm", command=fake_engine_command("vllm", port), engine_port=port,
                      listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="llm2", agent="",
                      idle_release_s=0.0, ready_timeout_s=60, mode=rota.ParkMode.DISCARD)
    s = serve_app(cfg)
    try:
        assert post_json(s.url + "/v1/completions", {"prompt": "a"})[0] == 200
        trainer = connect("trainer")
        trainer.acquire()
        assert "POST /sleep?level=2" in _calls(s.client.base_url)
        assert s.parker.dropped == ("weights", "kv_cache")
        trainer.release()
    finally:
        s.close(timeout_s=10)


def test_endpoint_client_reports_server_errors_with_their_words(fake_vllm):
    c = EndpointClient("vllm", fake_vllm.url)
    with pytest.raises(ServingError, match=r'POST http://127\.0\.0\.1:\d+/no/such/route answered HTTP 404: '
                                           r'\{"detail": "Not Found"\}'):
        c.call("POST", "/no/such/route")


def test_an_engine_that_names_several_devices_is_refused_before_it_starts(endpoint, monkeypatch, tmp_path):
    """An engine stays on the GPU it started on: a tenant naming several devices (rota could place a turn on
    another, which the engine could never follow) is refused, before the engine's long start, naming the fix."""
    port = free_port()
    started = tmp_path / "started"
    command = ["sh", "-c", f"touch {started}; exec \"$0\" \"$@\"", *fake_engine_command("vllm", port)]
    cfg = ServeConfig(app="vllm", command=command, engine_port=port, listen="127.0.0.1:0", orchestrator=endpoint,
                      group="g", tenant="llm3", agent="", idle_release_s=0.0, ready_timeout_s=60)
    monkeypatch.setenv("ROTA_DEVICES", "fake:0,fake:1")
    with pytest.raises(ConfigError, match=r"devices fake:0,fake:1 .* name several GPUs, but the vllm engine runs "
                                          r"on the GPU it started on.*ROTA_DEVICES=cuda:0"):
        serve_app(cfg)
    assert not started.exists()  # refused before the engine was started
    monkeypatch.setenv("ROTA_DEVICES", "fake:1")  # one device, the engine's own: served
    served = serve_app(cfg)
    try:
        assert served.gpu.devices == ("fake:1",) and started.exists()
    finally:
        served.close(timeout_s=10)


def test_tracking_an_engine_of_a_tenant_with_several_devices_is_refused(endpoint):
    gpu = rota.connect(group="g", tenant="llm4", endpoint=endpoint, devices=["fake:0", "fake:1"])
    try:
        with pytest.raises(ConfigError, match="the vllm engine of tenant 'llm4' runs on the GPU it started on"):
            track_endpoint(gpu, EndpointClient("vllm", "http://127.0.0.1:1"))
    finally:
        gpu.close()
