"""Commands listed by ``rota --help`` without importing them.

A :class:`LazyCommand` stands in the command table under its name and one-line help; the
command itself (``"module:attribute"``) is imported only when it is run or its own help is
asked for. So the command list costs no plugin's imports (grpc, yaml, aetcd, torch).
Plugins add theirs from ``rota_cli``::

    @hookimpl
    def rota_cli(cli):
        cli.add_command(LazyCommand("slurm", "rota_slurm.cli:slurm", "Slurm: ..."))

In any click group a stand-in runs as its command does; ``rota``'s own group also puts the
command in its table when it is first looked up (:func:`resolve`). The one-line help is
written twice (here and in the command's docstring); core's tests check that every
installed plugin's stand-in says what its command says.
"""

from __future__ import annotations

import importlib
from typing import Any

import click

__all__ = ["LazyCommand", "resolve"]


class LazyCommand(click.Command):
    """A stand-in for the command at ``target`` (``"package.module:attribute"``), listed with ``short_help``."""

    def __init__(self, name: str, target: str, short_help: str, *, hidden: bool = False) -> None:
        module, _, attr = target.partition(":")
        if not module or not attr:
            raise ValueError(f"LazyCommand {name!r}: target {target!r} is not 'package.module:attribute'")
        # as help, not short_help: the list then cuts it to the terminal's width as it cuts every other command's
        super().__init__(name, help=short_help, hidden=hidden, add_help_option=False)
        self.target = target

    def load(self) -> click.Command:
        """Import the command this stands for."""
        module, _, attr = self.target.partition(":")
        cmd = getattr(importlib.import_module(module), attr)
        if not isinstance(cmd, click.Command):
            raise TypeError(f"{self.target} is a {type(cmd).__name__}, not a click command")
        return cmd

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        """Parse as the real command, whose context then runs it: a stand-in works in any click group."""
        return self.load().make_context(info_name, args, parent=parent, **extra)


def resolve(group: click.Group, name: str) -> click.Command | None:
    """``group``'s command ``name``, imported (and put in the table in place of its stand-in) if lazy."""
    cmd = group.commands.get(name)
    if isinstance(cmd, LazyCommand):
        cmd = cmd.load()
        group.commands[name] = cmd
    return cmd
