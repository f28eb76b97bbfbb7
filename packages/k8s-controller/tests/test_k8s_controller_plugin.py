"""The plugin's ``rota k8s`` group: only the in-cluster commands (rota_k8s's fuller group replacing it is checked
in rota-scheduler-k8s's tests, the package that builds on this one)."""

from __future__ import annotations

import click
from click.testing import CliRunner

from rota.cli.lazy import resolve
from rota_k8s_controller import plugin


def test_alone_it_adds_a_k8s_group_with_the_two_in_cluster_commands() -> None:
    cli = click.Group("rota")
    plugin.rota_cli(cli=cli)
    result = CliRunner().invoke(cli, ["k8s", "controller", "--help"])  # the stand-in runs the command
    assert sorted(resolve(cli, "k8s").commands) == ["controller", "install-key"]
    assert result.exit_code == 0 and "--auth-key" in result.output

