"""rota's ``tinker`` plugin: adds ``rota tinker serve`` and ``rota serve tinker`` (``rota`` entry-point group)."""

from __future__ import annotations

import click

from rota import hookimpl


@hookimpl
def rota_cli(cli: click.Group) -> None:
    """Add ``rota tinker`` (serve) and ``tinker`` under ``rota serve`` (made here if no other plugin made it)."""
    from rota_tinker.cli import serve, serve_cmd, tinker

    cli.add_command(tinker)
    existing = cli.commands.get("serve")
    if isinstance(existing, click.Group):
        existing.add_command(serve_cmd, name="tinker")
    else:
        cli.add_command(serve)
