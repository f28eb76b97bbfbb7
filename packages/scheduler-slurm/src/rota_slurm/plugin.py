"""rota_slurm's hook implementations (entry point ``rota: rota_slurm``).

Adds ``rota slurm ...`` to the CLI and answers ``rota_place`` for scheduler ``"slurm"``
with the sbatch arguments of a time-sliced tenant (``--timeslice=G --gres=shard:1``).
"""

from __future__ import annotations

import click

from rota import hookimpl
from rota.cli.lazy import LazyCommand
from rota.types import Placement, TurnRequest


@hookimpl
def rota_cli(cli: click.Group) -> None:
    cli.add_command(LazyCommand("slurm", "rota_slurm.cli:slurm",
                                "rota on Slurm: `sbatch --timeslice=GROUP`, GRES shards, group status."))


@hookimpl
def rota_place(request: TurnRequest, scheduler: str) -> Placement | None:
    if scheduler != "slurm":
        return None
    from rota_slurm._place import place

    return place(request)
