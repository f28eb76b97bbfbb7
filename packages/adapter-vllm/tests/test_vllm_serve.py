"""Server mode against FakeVllmServer and a real orchestrator: park, wait-for-turn, restore.

The engine is the fake (a subprocess, started by :func:`rota_vllm.serve_app` exactly
as ``rota vllm serve`` starts vLLM); rota, the proxy and the HTTP protocol are real.
"""

from __future__ import annotations

import json
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import rota
from rota_vllm import EndpointClient, ServeConfig, VllmServer, check_server, serve_app
from rota_vllm.serving import free_port

FAKE = str(Path(__file__).with_name("vllm_fakes.py"))


def _post(url: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _calls(engine: str) -> list[str]:
    with urllib.request.urlopen(engine + "/fake/calls", timeout=10) as r:
        return json.loads(r.read())["calls"]


@pytest.fixture
def served(endpoint):
    port = free_port()
    cfg = ServeConfig(app="vllm", command=[sys.executable, FAKE, "--port", str(port)], engine_port=port,
                      listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="llm", agent="",
                      idle_release_s=0.0, ready_timeout_s=60, check_version=check_server)
    s = serve_app(cfg)
    yield s
    s.close(timeout_s=10)


def test_request_while_parked_waits_for_the_turn_then_succeeds(served, connect):
    engine = VllmServer(served.client.base_url)
    code, got = _post(served.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
    assert code == 200 and got["choices"][0]["text"] == " tok1"
    assert engine.is_sleeping() is False

    trainer = connect("trainer")
    trainer.acquire()  # the orchestrator parks the resident engine first: /sleep?level=1
    assert engine.is_sleeping() is True
    assert "POST /sleep?level=1" in _calls(engine.base_url)
    assert served.parker.dropped == ("kv_cache",)

    before = sum("/v1/completions" in c for c in _calls(engine.base_url))
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(r=_post(served.url + "/v1/completions", {"prompt": "x"})))
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

    code, got = _post(served.url + "/v1/completions", {"prompt": "again"})  # generation continues
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
    code, got = _post(served.url + "/sleep?level=2", {})
    assert code == 409 and "managed by rota" in got["error"]["message"]
    trainer.release()


def test_weight_sync_routes_reach_the_engine(served):
    engine = VllmServer(served.client.base_url)
    got = engine.collective_rpc("reload_weights")
    assert got == [{"method": "reload_weights", "args": []}]
    engine.reset_prefix_cache()
    assert "POST /reset_prefix_cache" in _calls(engine.base_url)


def test_discard_mode_sleeps_at_level_2(endpoint, connect):
    port = free_port()
    cfg = ServeConfig(app="vllm", command=[sys.executable, FAKE, "--port", str(port)], engine_port=port,
                      listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="llm2", agent="",
                      idle_release_s=0.0, ready_timeout_s=60, mode=rota.ParkMode.DISCARD)
    s = serve_app(cfg)
    try:
        assert _post(s.url + "/v1/completions", {"prompt": "a"})[0] == 200
        trainer = connect("trainer")
        trainer.acquire()
        assert "POST /sleep?level=2" in _calls(s.client.base_url)
        assert s.parker.dropped == ("weights", "kv_cache")
        trainer.release()
    finally:
        s.close(timeout_s=10)


def test_endpoint_client_reports_server_errors_with_their_words(fake_vllm):
    c = EndpointClient("vllm", fake_vllm.url)
    with pytest.raises(Exception, match="HTTP 404"):
        c.call("POST", "/no/such/route")
