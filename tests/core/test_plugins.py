"""Plugins: the entry-point group, `rota plugins`, ROTA_LOAD_PLUGINS, inline plugins."""

from __future__ import annotations

import json
import subprocess
import sys

from click.testing import CliRunner

import rota
from rota._plugins import describe, new_plugin_manager
from rota.cli.main import cli


def test_builtins_register_through_the_same_hooks():
    infos = {i.name: i for i in describe(new_plugin_manager(load_entry_points=False))}
    assert "rota_acquire" in infos["rota._lease_client"].hooks
    assert "rota_register_policies" in infos["rota.policies"].hooks


def test_rota_plugins_json_lists_hooks():
    result = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    names = [p["name"] for p in json.loads(result.output)]
    assert "rota._lease_client" in names


def test_inline_plugin_answers_acquire_first(orchestrator):
    """A plugin implementing rota_acquire takes precedence over the built-in gRPC client."""
    endpoint, engine = orchestrator

    class LocalLock:
        @rota.hookimpl
        def rota_acquire(self, request, tenant):
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
