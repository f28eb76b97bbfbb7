"""rota_sglang against FakeSglangServer (server mode) and a fake Engine (in-process), with a real orchestrator."""

from __future__ import annotations

import json
import threading
import types

import pytest
from click.testing import CliRunner

import rota
import rota_sglang
from rota import ParkPlan
from rota.errors import ConfigError, InvalidArgument
from rota.rpc import free_port
from rota.testing import cli_with_plugins
from rota_serving import ServeConfig, serve_app
from rota_serving.testing import FakeSglangServer, fake_engine_command, get_json, post_json
from rota_sglang import SglangServer, UnsupportedVersion, check_server, engine_command
from rota_sglang._server import server_client


def _state(engine: str) -> dict:
    return get_json(engine + "/fake/calls")


def test_served_sglang_releases_when_parked_and_requests_wait_for_the_turn(endpoint, connect):
    port = free_port()
    s = serve_app(ServeConfig(app="sglang", command=fake_engine_command("sglang", port), engine_port=port,
                              listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="sgl", agent="",
                              idle_release_s=0.0, ready_timeout_s=60, check_version=check_server))
    try:
        assert post_json(s.url + "/generate", {"text": "hi"}) == (200, {"text": " tok1"})
        trainer = connect("trainer")
        trainer.acquire()
        st = _state(s.client.base_url)
        assert st["released"] == ["cuda_graph", "kv_cache", "weights"]
        assert "POST /release_memory_occupation {}" in st["calls"]

        result: dict = {}
        t = threading.Thread(target=lambda: result.update(r=post_json(s.url + "/generate", {"text": "x"})))
        t.start()
        t.join(0.5)
        assert t.is_alive(), f"the request did not wait for the turn: {result}"
        trainer.release()
        t.join(30)
        assert result["r"] == (200, {"text": " tok2"})
        assert _state(s.client.base_url)["released"] == []
        assert s.parker.dropped == ("kv_cache",)  # the default client: the engine backs its weights up
        eng = SglangServer(s.url)  # weight sync through the proxy: runs in the engine's turn
        assert eng.update_weights_from_disk("/ckpt/step-1")["success"] is True
        eng.flush_cache()
    finally:
        s.close(timeout_s=10)


def test_served_sglang_without_a_weights_backup_reports_the_weights_dropped(endpoint, connect):
    """``--backup none``: a release drops the weights, and the parker says so (an RL loop pushes fresh ones);
    reporting only the KV cache would let the next rollout run on whatever the memory held."""
    port = free_port()
    s = serve_app(ServeConfig(app="sglang", command=fake_engine_command("sglang", port), engine_port=port,
                              listen="127.0.0.1:0", orchestrator=endpoint, group="g", tenant="sgl-nb", agent="",
                              idle_release_s=0.0, ready_timeout_s=60, check_version=check_server,
                              client_factory=lambda url, timeout: server_client("none", url, timeout)))
    try:
        assert post_json(s.url + "/generate", {"text": "hi"})[0] == 200
        trainer = connect("trainer-nb")
        trainer.acquire()
        assert s.parker.dropped == ("weights", "kv_cache")
        trainer.release()
    finally:
        s.close(timeout_s=10)


def test_server_version_mismatch_names_the_fix():
    with FakeSglangServer(version="0.3.0").running() as srv:
        with pytest.raises(UnsupportedVersion) as info:
            check_server(SglangServer(srv.url))
        msg = str(info.value)
        assert "sglang 0.3.0" in msg and 'pip install "sglang>=0.4.6,<0.6"' in msg


def test_update_weights_refusal_carries_the_servers_words():
    with FakeSglangServer().running() as srv:
        with pytest.raises(InvalidArgument, match="model_path is empty"):
            SglangServer(srv.url).update_weights_from_disk("")


class FakeEngine:
    """Fake of sglang.Engine's memory-occupation and weight-update methods (records calls)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def release_memory_occupation(self, tags=None):
        self.calls.append(("release", tags))

    def resume_memory_occupation(self, tags=None):
        self.calls.append(("resume", tags))

    def update_weights_from_tensor(self, named_tensors):
        self.calls.append(("update", len(named_tensors)))


def test_in_process_engine_is_released_and_resumed_around_turns(connect):
    gpu = connect("sgl-inproc")
    eng = FakeEngine()
    tracked = rota_sglang.track(gpu, eng, check_version=False)
    gpu.acquire()
    gpu.release()
    trainer = connect("trainer")
    trainer.acquire()
    assert eng.calls == [("release", None)]
    assert tracked.dropped == ("weights", "kv_cache", "cuda_graph") and tracked.weights_stale
    trainer.release()
    gpu.acquire()
    assert eng.calls[-1] == ("resume", None)
    assert tracked.update_weights([("w", 1.0)]) == 1 and not tracked.weights_stale
    gpu.release()
    tracked.untrack()


def test_a_resident_engine_reports_its_footprint_so_a_capacity_counts_it(connect):
    """rota_footprint while resident: the bytes given (a capacity then counts the engine); unknown (no CUDA in this
    process, nothing given) 1 byte, so the orchestrator still parks it for room; 0 once released."""
    gpu = connect("sgl-footprint")
    sized = rota_sglang.track(gpu, FakeEngine(), footprint_bytes=5 << 30, check_version=False)
    assert sized.rota_footprint(gpu) == {"engine": 5 << 30}
    sized.rota_park(gpu, ParkPlan())
    assert sized.rota_footprint(gpu) == {"engine": 0}
    sized.untrack()
    eng = FakeEngine()
    eng.server_args = types.SimpleNamespace(mem_fraction_static=0.5, enable_memory_saver=True)
    unknown = rota_sglang.track(gpu, eng, check_version=False)  # CPU: no device to take half of
    assert unknown.rota_footprint(gpu) == {"engine": 1}
    unknown.untrack()
    for bad in (-1, True, 1.5, "5GB"):
        with pytest.raises(rota_sglang.TrackingError, match=r"footprint_bytes=.* must be a whole number of bytes"):
            rota_sglang.track(gpu, FakeEngine(), footprint_bytes=bad, check_version=False)


def test_bad_inputs_are_refused_with_the_fix(connect):
    gpu = connect("bad")
    with pytest.raises(InvalidArgument, match="'activations' is not a sglang memory tag"):
        rota_sglang.track(gpu, FakeEngine(), tags=["activations"], check_version=False)
    with pytest.raises(rota_sglang.TrackingError, match="has no release_memory_occupation"):
        rota_sglang.track(gpu, object(), check_version=False)
    with pytest.raises(InvalidArgument, match="rota owns the engine's address"):
        engine_command(["m", "--port", "1"], 5)
    with pytest.raises(UnsupportedVersion, match=r"sglang is not installed.*pip install"):
        rota_sglang.require_sglang()


def test_cli_serve_dry_run_builds_the_engine_command():
    cli = cli_with_plugins()  # through the `rota` entry point: proves the plugin is wired
    res = CliRunner().invoke(cli, ["sglang", "serve", "--dry-run", "--", "Qwen/Qwen3-0.6B"])
    assert res.exit_code == 0, res.output
    cmd = json.loads(res.output)["command"]
    assert cmd[1:5] == ["-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3-0.6B"]
    assert "--enable-memory-saver" in cmd and "--enable-weights-cpu-backup" in cmd  # an offload keeps weights
    res = CliRunner().invoke(cli, ["sglang", "serve", "--dry-run", "--backup", "none", "--", "Qwen/Qwen3-0.6B"])
    assert res.exit_code == 0, res.output
    assert "--enable-weights-cpu-backup" not in json.loads(res.output)["command"]
    res = CliRunner().invoke(cli, ["sglang", "serve", "--dry-run", "--backup", "none", "--", "m",
                                   "--enable-weights-cpu-backup"])
    assert res.exit_code == 2 and "--enable-weights-cpu-backup with --backup none" in res.output, res.output


def test_an_engine_of_a_tenant_naming_several_devices_is_refused(endpoint):
    """SGLang stays on the GPU it started on: rota must never place its turn on another."""
    gpu = rota.connect(group="g", tenant="sgl-2gpu", endpoint=endpoint, devices=["fake:0", "fake:1"])
    try:
        with pytest.raises(ConfigError, match=r"the sglang\.Engine of tenant 'sgl-2gpu' runs on the GPU it started on"):
            rota_sglang.track(gpu, FakeEngine(), check_version=False)
    finally:
        gpu.close()
