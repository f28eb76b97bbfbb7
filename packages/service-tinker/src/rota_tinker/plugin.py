"""rota's ``tinker`` plugin: adds ``rota tinker serve`` and ``rota serve tinker`` (``rota`` entry-point group)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rota import hookimpl

if TYPE_CHECKING:
    import click


@hookimpl
def rota_cli(cli: click.Group) -> None:
    """Add ``rota tinker`` (serve) and the hidden ``rota serve`` group holding ``tinker`` (its alias)."""
    from rota_tinker.cli import serve, tinker

    cli.add_command(tinker)
    cli.add_command(serve)
