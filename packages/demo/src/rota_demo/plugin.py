"""Entry point of rota-demo in the ``rota`` group: adds ``rota demo`` to the CLI through ``rota_cli``.

Imports only click and the command's definition; torch, matplotlib and the adapter load
when the command runs.
"""

from __future__ import annotations

import click

from rota import hookimpl
from rota_demo.cli import demo

__all__ = ["rota_cli"]


@hookimpl
def rota_cli(cli: click.Group) -> None:
    """Add ``rota demo``."""
    cli.add_command(demo)
