"""``rota``: the top-level click group. Plugins add subcommands through ``rota_cli``."""

from __future__ import annotations

import importlib.metadata
import logging
import sys

import click

from rota._plugins import plugin_manager
from rota.cli.orchestrator import orchestrator
from rota.cli.plugins import plugins
from rota.cli.status import status
from rota.cli.token import token
from rota.errors import RotaError


def _print_versions(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """``rota --version``: every installed rota distribution and its version (core and plugins)."""
    if not value or ctx.resilient_parsing:
        return
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name.startswith("rota-") and name != "rota-workspace":  # the repository's own dev tooling is none
            seen[name] = dist.version
    for name in sorted(seen):
        click.echo(f"{name} {seen[name]}")
    ctx.exit()


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_versions,
              help="Print the version of every installed rota distribution and exit.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="warning",
              envvar="ROTA_LOG_LEVEL", show_default=True, help="Logging verbosity (env ROTA_LOG_LEVEL).")
def cli(log_level: str) -> None:
    """rota: co-operative GPU time-slicing for RL and post-training jobs.

    Jobs ("tenants") in the same group take turns on its GPUs: a job yields when it
    does not need the device, rota parks its state in host memory and restores the
    next job. Start with `rota demo` (pip install rota-demo); `rota status` shows who holds what.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


cli.add_command(status)
cli.add_command(plugins)
cli.add_command(orchestrator)
cli.add_command(token)


def _add_plugin_commands() -> None:
    """Let each plugin add its commands; a broken plugin costs one line, not the CLI."""
    for impl in plugin_manager().hook.rota_cli.get_hookimpls():
        try:
            impl.function(cli=cli)
        except Exception as exc:
            click.echo(f"rota: plugin {impl.plugin_name} could not add its commands: {exc}", err=True)


def main() -> None:
    """Entry point of the ``rota`` executable."""
    _add_plugin_commands()
    try:
        cli.main(standalone_mode=True)
    except RotaError as exc:  # library errors reach users as one clear line
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
