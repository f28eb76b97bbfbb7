"""Validation of job and group ids, shared by the client, servers and CLI.

Ids travel in etcd keys, Slurm env vars and Kubernetes labels, so they are limited to
what all three accept: letters, digits, ``.``, ``_``, ``-``, ``:``; 1-128 characters,
starting with a letter or digit.
"""

from __future__ import annotations

import re

from rota.errors import InvalidArgument

_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")


def check_id(kind: str, value: str, *, job_id: str = "", group_id: str = "") -> str:
    """Return ``value`` if it is a valid id, else raise InvalidArgument naming it."""
    if not value:
        raise InvalidArgument(
            f"{kind} is empty (job={job_id!r}, group={group_id!r}); give a non-empty {kind}",
            job_id=job_id, group_id=group_id)
    if not _ID.match(value):
        raise InvalidArgument(
            f"{kind} {value!r} is malformed (job={job_id!r}, group={group_id!r}): use 1-128 of "
            "letters, digits, '.', '_', '-', ':' starting with a letter or digit",
            job_id=job_id, group_id=group_id)
    return value


def check_pair(job_id: str, group_id: str) -> None:
    """Validate a job id and a group id together (the usual RPC pair)."""
    check_id("job_id", job_id, job_id=job_id, group_id=group_id)
    check_id("group_id", group_id, job_id=job_id, group_id=group_id)
