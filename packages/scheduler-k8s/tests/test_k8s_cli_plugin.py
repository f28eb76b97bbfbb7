"""``rota k8s`` when rota_k8s_controller is installed too: rota_k8s's full group takes the name."""

from __future__ import annotations

import click

from rota.cli.lazy import resolve
from rota.testing import new_plugin_manager
from rota_k8s import plugin
from rota_k8s_controller import plugin as controller_plugin


def test_the_full_group_takes_the_name_in_either_registration_order() -> None:
    """Neither plugin reads the other's commands: rota_k8s's ``rota_cli`` is trylast, so its group replaces the
    controller's (controller and install-key only) whichever registered first."""
    for order in ((controller_plugin, plugin), (plugin, controller_plugin)):
        pm = new_plugin_manager(load_entry_points=False)
        for module in order:
            pm.register(module)
        cli = click.Group("rota")
        pm.hook.rota_cli(cli=cli)
        assert {"render", "tenant", "status", "controller", "install-key"} <= set(resolve(cli, "k8s").commands)
