"""The plugin's ``rota k8s`` group: only the in-cluster commands, and never over rota_k8s's full group."""

from __future__ import annotations

import click
from click.testing import CliRunner

from rota_k8s_controller import plugin


def test_alone_it_adds_a_k8s_group_with_the_two_in_cluster_commands() -> None:
    cli = click.Group("rota")
    plugin.rota_cli(cli=cli)
    assert sorted(cli.commands["k8s"].commands) == ["controller", "install-key"]
    result = CliRunner().invoke(cli, ["k8s", "controller", "--help"])
    assert result.exit_code == 0 and "--auth-key" in result.output


def test_it_leaves_a_k8s_group_that_is_there_already() -> None:
    cli = click.Group("rota")
    full = click.Group("k8s")
    cli.add_command(full)
    plugin.rota_cli(cli=cli)
    assert cli.commands["k8s"] is full
