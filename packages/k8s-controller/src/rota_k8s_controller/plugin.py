"""rota's ``k8s`` in-cluster plugin: ``rota k8s controller`` and ``rota k8s install-key``.

Registered through the ``rota`` entry-point group. When rota-scheduler-k8s is installed
too, its ``rota k8s`` group (which holds these commands as well) takes the name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def rota_cli(cli: click.Group) -> None:
    """Add ``rota k8s`` with the two in-cluster commands, unless the full group is there already."""
    from rota_k8s_controller.cli import k8s

    if "k8s" not in cli.commands:
        cli.add_command(k8s)
