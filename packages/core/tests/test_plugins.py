"""Plugins: the entry-point group, `rota plugins`, ROTA_LOAD_PLUGINS, inline plugins."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

from click.testing import CliRunner

import rota
from rota._plugins import describe, new_plugin_manager
from rota.cli.main import cli


def test_builtins_register_through_the_same_hooks():
    infos = {i.name: i for i in describe(new_plugin_manager(load_entry_points=False))}
    assert "rota_acquire" in infos["rota._tenant.lease"].hooks
    assert "rota_register_policies" in infos["rota.policies"].hooks


def test_rota_plugins_json_lists_hooks():
    result = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    names = [p["name"] for p in json.loads(result.output)]
    assert "rota._tenant.lease" in names


def test_inline_plugin_answers_acquire_first(orchestrator):
    """A plugin implementing rota_acquire takes precedence over the built-in gRPC client."""
    endpoint, engine = orchestrator

    class LocalLock:
        @rota.hookimpl
        def rota_acquire(self, request):
            return rota.Grant(request.job_id, request.group_id, token=99)

    gpu = rota.connect(group="g", tenant="inline", endpoint=endpoint)
    plugin = LocalLock()
    gpu.pm.register(plugin)
    try:
        assert gpu.acquire().token == 99
        assert "g" not in engine.groups or engine.groups["g"].holder != "inline"
    finally:
        gpu.pm.unregister(plugin)
        gpu.grant = None
        gpu.close()


def test_load_plugins_env_names_missing_distribution():
    r = subprocess.run([sys.executable, "-m", "rota", "plugins"], capture_output=True, text=True, timeout=60,
                       env={"ROTA_LOAD_PLUGINS": "rota-not-installed", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0
    assert "ROTA_LOAD_PLUGINS names 'rota-not-installed', which is not installed" in r.stderr


def test_orchestrator_serve_serves_what_a_rota_orchestrator_plugin_returns(tmp_path):
    """rota_orchestrator: `rota orchestrator serve` passes --etcd, --listen and the config to the hook, hands the
    answer the health servicer before starting it, and serves it (a Status call over the socket reaches it)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from rota import plugin_manager
    from rota.orchestrator import LEADER_HEALTH, Orchestrator
    from rota.wire import rota_v1_pb2, rota_v1_pb2_grpc

    seen: dict = {}
    listen = f"unix:{tmp_path}/orchestrator.sock"

    class PluginEngine(Orchestrator):
        def report_health_to(self, health):
            seen["health before start"] = "started" not in seen

        async def start(self):
            seen["started"] = True
            await super().start()
            self.probing = asyncio.ensure_future(self.probe())

        async def probe(self):
            async with grpc.aio.insecure_channel(listen) as ch:
                reply = await rota_v1_pb2_grpc.RotaServiceStub(ch).Status(rota_v1_pb2.StatusRequest(), timeout=30,
                                                                          wait_for_ready=True)
                health = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=LEADER_HEALTH), timeout=30)
            seen["served"] = reply.orchestrator
            seen["leader health"] = health_pb2.HealthCheckResponse.ServingStatus.Name(health.status)
            self.stopped.set()

    class Plugin:
        @rota.hookimpl
        def rota_orchestrator(self, config, url, listen):
            seen["asked"] = (url, listen, config.policy.name)
            return PluginEngine(config, name="from the plugin")

    pm, plugin = plugin_manager(), Plugin()
    pm.register(plugin)  # registered last: asked before rota_etcd's, which would answer --etcd too
    try:
        result = CliRunner().invoke(cli, ["orchestrator", "serve", "--listen", listen, "--etcd", "store://x",
                                          "--policy", "priority"])
    finally:
        pm.unregister(plugin)
    assert result.exit_code == 0, result.output
    assert seen["asked"] == ("store://x", listen, "priority")
    assert seen["health before start"] is True
    assert (seen["served"], seen["leader health"]) == ("from the plugin", "SERVING")


def test_etcd_option_without_a_store_plugin_names_the_package_to_install(tmp_path, child_env):
    """No plugin answers rota_orchestrator or rota_store for --etcd: a usage error, not an in-memory orchestrator."""
    r = subprocess.run([sys.executable, "-m", "rota", "orchestrator", "serve", "--listen",
                        f"unix:{tmp_path}/o.sock", "--etcd", "http://127.0.0.1:1"], capture_output=True, text=True,
                       timeout=60, env=dict(child_env, ROTA_LOAD_PLUGINS=""))
    assert r.returncode == 2, r.stderr
    assert "--etcd http://127.0.0.1:1 needs the etcd store plugin: pip install rota-orchestrator-etcd" in r.stderr


def test_a_plugins_own_hook_spec_is_added_as_it_registers():
    """rota_add_hookspecs is historic: a plugin registered after the manager was made still adds its spec."""
    from rota.testing import new_plugin_manager as fresh

    class Specs:
        @rota.hookspecs.hookspec(firstresult=True)
        def rota_test_answer(self, question):
            """A third party's hook."""

    class Owner:
        @rota.hookimpl
        def rota_add_hookspecs(self, pluginmanager):
            pluginmanager.add_hookspecs(Specs)

    class Answerer:
        @rota.hookimpl
        def rota_test_answer(self, question):
            return f"{question}: 42"

    pm = fresh(load_entry_points=False)
    pm.register(Owner())
    pm.register(Answerer())
    assert pm.hook.rota_test_answer.spec is not None
    assert pm.hook.rota_test_answer(question="q") == "q: 42"  # firstresult: the spec's options hold


def test_call_each_isolates_a_failing_plugin_and_names_each_result():
    from rota.hookspecs import call_each
    from rota.testing import new_plugin_manager as fresh

    class Adds:
        def __init__(self, name):
            self.name = name

        @rota.hookimpl
        def rota_cli(self, cli):
            if self.name == "broken":
                raise RuntimeError("no commands today")
            cli.append(self.name)
            return self.name

    pm = fresh(load_entry_points=False)
    for name in ("first", "broken", "last"):
        pm.register(Adds(name), name=name)
    errors, added = [], []
    got = call_each(pm.hook.rota_cli, on_error=lambda plugin, exc: errors.append((plugin, str(exc))), cli=added)
    assert got == [("last", "last"), ("first", "first")]  # pm.hook's order: the last registered first
    assert errors == [("broken", "no commands today")] and added == ["last", "first"]
    try:
        call_each(pm.hook.rota_cli, cli=[])
    except RuntimeError as exc:
        assert "no commands today" in str(exc)
    else:
        raise AssertionError("without on_error a plugin's error propagates")


def test_cli_with_plugins_holds_each_installed_plugins_commands():
    from rota.testing import cli_with_plugins

    group = cli_with_plugins()
    assert {"status", "agent", "k8s", "slurm", "demo"} <= set(group.commands)
    assert {"render", "controller", "install-key"} <= set(group.commands["k8s"].commands)  # rota_k8s's, trylast


def test_a_plugin_whose_hook_specs_fail_costs_one_line_not_rota(tmp_path):
    """An installed distribution (a real dist-info on the path) whose rota_add_hookspecs fails (its spec module is
    missing): rota still starts, names it in one line, and keeps every other plugin and their specs."""
    (tmp_path / "twice_specs.py").write_text(
        "import rota\n\n@rota.hookimpl\ndef rota_add_hookspecs(pluginmanager):\n"
        "    from twice_specs_missing import hookspecs\n    pluginmanager.add_hookspecs(hookspecs)\n")
    info = tmp_path / "rota_twice_specs-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: rota-twice-specs\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[rota]\ntwice_specs = twice_specs\n")
    r = subprocess.run([sys.executable, "-m", "rota", "plugins", "--json"], capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    assert "plugin rota-twice-specs (twice_specs) failed to load: No module named 'twice_specs_missing'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    names = {p["name"] for p in json.loads(r.stdout)}
    assert "twice_specs" not in names and {"rota_agent", "rota_serving"} <= names
    hooks = {p["name"]: p["hooks"] for p in json.loads(r.stdout)}
    assert "rota_agent_backends" in hooks["rota_agent"]
