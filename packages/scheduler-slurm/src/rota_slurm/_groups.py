"""Group names with placeholders, as ``--timeslice=GROUP`` takes them.

The SPANK plugin expands, per node and job step, ``%n`` to the node name and ``%g`` to
the GPU set the step's GRES sit on (``gpu0``, ``gpu0_1``: Slurm's global indices,
sorted). This module is the Python side of the same rules: checking a pattern before
``sbatch`` sees it, and finding the groups a pattern expanded to when only the pattern
is known (the job epilog evicts a job from every such group of its node, since each
step had the group of its own GPUs).
"""

from __future__ import annotations

import re

from rota.config import check_id
from rota.errors import InvalidArgument

__all__ = ["GPU_SET", "check_pattern", "expand_node", "pattern_regex"]

# What %g expands to: "gpu" and the sorted GPU indices joined by "_" (no "+": ids allow
# only letters, digits, '.', '_', '-', ':').
GPU_SET = r"gpu[0-9]+(?:_[0-9]+)*"


def check_pattern(group: str) -> str:
    """Return ``group`` if it is a valid group once ``%n``/``%g`` are expanded, else raise InvalidArgument."""
    try:
        check_id("group", group.replace("%n", "node").replace("%g", "gpu0"), group_id=group)
    except InvalidArgument:
        raise InvalidArgument(
            f"group {group!r} is malformed: use 1-128 of letters, digits, '.', '_', '-', ':' starting with a "
            "letter or digit, plus %n (the node name) and %g (the job's GPUs there, e.g. gpu0_1)",
            group_id=group) from None
    return group


def expand_node(group: str, node: str) -> str:
    """``group`` with ``%n`` replaced by ``node`` (``%g`` is left for :func:`pattern_regex`)."""
    return group.replace("%n", node)


def pattern_regex(group: str) -> re.Pattern[str]:
    """A regex matching every group that ``group`` (``%n`` already expanded) can become through ``%g``."""
    parts = group.split("%g")
    return re.compile("^" + GPU_SET.join(re.escape(p) for p in parts) + "$")
