"""rota's ``tinker`` plugin: adds ``rota tinker serve`` and ``rota serve tinker`` (``rota`` entry-point group)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def rota_cli(cli: click.Group) -> None:
    """Add ``rota tinker`` (serve) and the hidden ``rota serve`` group holding ``tinker`` (its alias)."""
    from rota.cli.lazy import LazyCommand

    cli.add_command(LazyCommand("tinker", "rota_tinker.cli:tinker",
                                "A Tinker-API-compatible training service whose tenants take turns on GPUs."))
    cli.add_command(LazyCommand("serve", "rota_tinker.cli:serve", "Run a service whose tenants take turns on GPUs "
                                "(``rota serve tinker``, an alias of ``rota tinker serve``).", hidden=True))
