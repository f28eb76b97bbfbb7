"""``rota``: the top-level click group. Plugins add subcommands through ``rota_cli``.

Commands load lazily, so a command pays only for what it imports: ``rota status`` imports
neither the orchestrator nor any plugin, plugins' commands (some bring torch) are added only
when one of them is asked for, and ``rota --help`` lists every command from its
:class:`~rota.cli.lazy.LazyCommand` stand-in without importing any.
``--log-level`` is accepted anywhere on the command line: every command gets it too.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
from typing import Any

import click

from rota.cli.lazy import LazyCommand, resolve
from rota.errors import RotaError

LOG_LEVELS = ("debug", "info", "warning", "error")
# core's commands: name -> ("module:attribute", its one-line help); imported when the command is used
CORE_COMMANDS = {
    "status": ("rota.cli.status:status",
               "Show holder, queue, loaded job and per-tenant GPU time and waits of GROUP (or all)."),
    "plugins": ("rota.cli.plugins:plugins",
                "List rota plugins (built-in and from the `rota` entry-point group) and their hooks."),
    "orchestrator": ("rota.cli.orchestrator:orchestrator",
                     "Run or inspect the orchestrator that decides who holds each group."),
    "token": ("rota.cli.token:token", "Credentials for an orchestrator started with --auth-key FILE."),
}


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


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """A subcommand's ``--log-level``: the same setting as the top-level one, given after the subcommand."""
    if value and not ctx.resilient_parsing:
        logging.getLogger().setLevel(value.upper())


def _passes_arguments_through(cmd: click.Command) -> bool:
    """A command that takes any number of arguments, mostly to hand to another program (sbatch, an inference
    engine, a tenant's command line): a ``--log-level`` among them is that program's."""
    return any(isinstance(p, click.Argument) and p.nargs == -1 for p in cmd.params)


def _with_log_level(cmd: click.Command) -> click.Command:
    """Give ``cmd`` (and a group's subcommands) a hidden ``--log-level``, unless it passes arguments through."""
    if not _passes_arguments_through(cmd) and not any(p.name == "log_level_anywhere" for p in cmd.params):
        cmd.params.append(click.Option(["--log-level", "log_level_anywhere"], type=click.Choice(LOG_LEVELS),
                                       expose_value=False, is_eager=True, hidden=True, callback=_set_log_level))
    if isinstance(cmd, click.Group):
        for sub in cmd.commands.values():
            _with_log_level(sub)
    return cmd


class RotaGroup(click.Group):
    """The top-level group: core's and plugins' commands are :class:`LazyCommand` stand-ins, imported
    when one is used; ``rota --help`` lists them from their one-line help without importing any."""

    plugins_added = False
    listing = False  # format_commands is running: keep the stand-ins

    def _add_core(self, name: str) -> None:
        if name in CORE_COMMANDS and name not in self.commands:
            target, short_help = CORE_COMMANDS[name]
            self.add_command(LazyCommand(name, target, short_help))

    def _add_plugins(self) -> None:
        """Let each plugin add its commands; a broken plugin costs one line, not the CLI."""
        if self.plugins_added:
            return
        self.plugins_added = True
        from rota._plugins import plugin_manager
        from rota.hookspecs import call_each

        def report(plugin: str, exc: Exception) -> None:
            click.echo(f"rota: plugin {plugin} could not add its commands: {exc}", err=True)

        call_each(plugin_manager().hook.rota_cli, on_error=report, cli=self)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        self._add_core(cmd_name)
        if cmd_name not in self.commands:
            self._add_plugins()
        if self.listing:
            return self.commands.get(cmd_name)
        try:
            cmd = resolve(self, cmd_name)
        except Exception as exc:  # a plugin's command that cannot be imported: say which, as a broken plugin does
            raise click.ClickException(f"the command {cmd_name!r} could not be loaded: {exc}") from exc
        return _with_log_level(cmd) if cmd is not None else None

    def list_commands(self, ctx: click.Context) -> list[str]:
        for name in CORE_COMMANDS:
            self._add_core(name)
        self._add_plugins()
        return super().list_commands(ctx)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        self.listing = True
        try:
            super().format_commands(ctx, formatter)
        finally:
            self.listing = False


@click.group(cls=RotaGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_versions,
              help="Print the version of every installed rota distribution and exit.")
@click.option("--log-level", type=click.Choice(LOG_LEVELS), default="warning", envvar="ROTA_LOG_LEVEL",
              show_default=True, help="Logging verbosity (env ROTA_LOG_LEVEL); accepted after any subcommand too.")
def cli(log_level: str) -> None:
    """rota: co-operative GPU time-slicing for RL and post-training jobs.

    Jobs ("tenants") in the same group take turns on its GPUs: a job yields when it
    does not need the device, rota parks its state in host memory and restores the
    next job. Start with `rota demo` (pip install rota-demo); `rota status` shows who holds what.
    """
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger().setLevel(log_level.upper())  # also where logging was set up before (an embedding program)


def main(args: Any = None) -> None:
    """Entry point of the ``rota`` executable."""
    try:
        cli.main(args, standalone_mode=True)
    except RotaError as exc:  # library errors reach users as one clear line
        click.echo(f"Error: {exc}", err=True)
        sys.exit(2)
