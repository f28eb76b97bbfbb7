"""Placement of time-sliced tenants on Slurm: the sbatch arguments of one tenant.

A tenant of group G is one Slurm job with ``--timeslice=G`` and one shard of a GPU
(``--gres=shard:1``); every tenant of a group must land on the same node and GPUs, so
the group is pinned to a node (``--nodelist``) when the caller names one, or named
after the node and GPUs the job lands on (``%n-%g``, expanded by the SPANK plugin).
``rota slurm submit`` and the ``rota_place`` hook both use :func:`place`.
"""

from __future__ import annotations

from rota.types import Placement, TurnRequest
from rota_slurm._groups import check_pattern


def sbatch_args(group: str, *, shards: int = 1, node: str = "", priority: int = 0) -> list[str]:
    """sbatch arguments that make a job a tenant of ``group`` (``%n``/``%g`` allowed)."""
    check_pattern(group)
    args = [f"--timeslice={group}", f"--gres=shard:{shards}"]
    if node:
        args.append(f"--nodelist={node}")
    if priority:
        args.append(f"--timeslice-priority={priority}")
    return args


def place(request: TurnRequest, *, node: str = "", shards: int = 1) -> Placement:
    """The Slurm placement of ``request``: GRES string, group option, node."""
    args = sbatch_args(request.group_id, shards=shards, node=node, priority=request.priority)
    details = {"gres": f"shard:{shards}", "timeslice": request.group_id, "sbatch_args": " ".join(args)}
    if node:
        details["nodelist"] = node
    return Placement(scheduler="slurm", group_id=request.group_id, details=details)
