"""rota's ``tinker`` plugin: adds ``rota tinker serve`` (registered through the ``rota`` entry-point group)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def rota_cli(cli: click.Group) -> None:
    """Add ``rota tinker`` (serve)."""
    from rota_tinker.cli import tinker

    cli.add_command(tinker)
