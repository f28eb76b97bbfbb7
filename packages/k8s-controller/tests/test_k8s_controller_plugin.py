"""The plugin's ``rota k8s`` group: only the in-cluster commands, and never over rota_k8s's full group."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from rota.testing import new_plugin_manager
from rota_k8s_controller import plugin


def test_alone_it_adds_a_k8s_group_with_the_two_in_cluster_commands() -> None:
    cli = click.Group("rota")
    plugin.rota_cli(cli=cli)
    assert sorted(cli.commands["k8s"].commands) == ["controller", "install-key"]
    result = CliRunner().invoke(cli, ["k8s", "controller", "--help"])
    assert result.exit_code == 0 and "--auth-key" in result.output


def test_rota_k8s_s_full_group_takes_the_name_in_either_registration_order() -> None:
    """Neither plugin reads the other's commands: rota_k8s's ``rota_cli`` is trylast, so its group replaces this one."""
    rota_k8s_plugin = pytest.importorskip("rota_k8s.plugin")  # installed by ./dev setup
    for order in ((plugin, rota_k8s_plugin), (rota_k8s_plugin, plugin)):
        pm = new_plugin_manager(load_entry_points=False)
        for module in order:
            pm.register(module)
        cli = click.Group("rota")
        pm.hook.rota_cli(cli=cli)
        assert {"render", "tenant", "controller", "install-key"} <= set(cli.commands["k8s"].commands)
