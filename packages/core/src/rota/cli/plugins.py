"""``rota plugins``: what is installed and which hooks each plugin implements."""

from __future__ import annotations

import json

import click

from rota._plugins import describe, plugin_manager

__all__ = ["plugins"]


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
def plugins(as_json: bool) -> None:
    """List rota plugins (built-in and from the `rota` entry-point group) and their hooks.

    The first thing to run when a plugin seems to do nothing. ROTA_LOAD_PLUGINS=a,b
    limits which installed distributions load.
    """
    infos = describe(plugin_manager())
    if as_json:
        click.echo(json.dumps([info.__dict__ for info in infos], indent=2))
        return
    width = max(len(i.name) for i in infos)
    for info in infos:
        click.echo(f"{info.name:<{width}}  {info.distribution} {info.version}")
        click.echo(f"{'':<{width}}  hooks: {', '.join(info.hooks) or '-'}")
