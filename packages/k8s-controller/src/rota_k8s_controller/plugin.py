"""rota's ``k8s`` in-cluster plugin: ``rota k8s controller`` and ``rota k8s install-key``.

Registered through the ``rota`` entry-point group. When rota-scheduler-k8s is installed
too, its ``rota k8s`` group (which holds these commands as well) takes the name: its
``rota_cli`` is ``trylast``, so it is added after this one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def rota_cli(cli: click.Group) -> None:
    """Add ``rota k8s`` with the two in-cluster commands (rota_k8s's fuller group replaces it when installed)."""
    from rota.cli.lazy import LazyCommand

    cli.add_command(LazyCommand("k8s", "rota_k8s_controller.cli:k8s", "rota on Kubernetes, in-cluster side: the pod "
                                "controller and the auth key's init container."))
